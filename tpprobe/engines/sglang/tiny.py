"""Tiny random-weight SGLang models on CPU gloo: `tpprobe probe --engine sglang --arch ...`.

`build_target(ctx, arch, ...)` builds SGLang's own `LlamaForCausalLM` or `DeepseekV2ForCausalLM`
(MLA, optionally with an MoE layer) on this rank, sharded by SGLang's parallel state, which
`tpprobe.engines.sglang.dist` publishes over the probe's already-initialized gloo world. Weights: one
full, seeded tensor set (identical on every rank), generated through the HF transformers model
of the same config and loaded with the SGLang model's own `load_weights` (which shards it).
The forward is an EXTEND batch of `tokens` tokens with the `torch_native` attention backend and
`CaptureHiddenMode.FULL`, so the returned `LogitsProcessorOutput.hidden_states` is the packed aux
tensor SGLang hands the EAGLE-3 draft, for every token.

Layer ids: `layer_ids` are passed VERBATIM to SGLang's `set_eagle3_layers_to_capture` (the ids a
draft model's config names). What each one captures depends on the arch; see
`tpprobe.engines.sglang.layer_ids` (Llama: +1 always; DeepSeek: +1 only when the first id is 1). `None` means
SGLang's default ids; `[]` turns capture off. Ids that would crash SGLang's forward raise
UsageError before the model is built.

The architectures and their configs are in tiny_archs.py; the seeded weights, and `hf_reference(...)`
(HF's per-layer hidden states on the same weights, so tests can prove what each aux slot holds), in
tiny_weights.py.

CPU only: this module enables `tpprobe.engines.sglang.cpu_mode`.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch

from tpprobe.core.errors import UsageError
from tpprobe.core.target import ProbeTarget, RankContext
from tpprobe.engines.sglang import SGLANG_VERSION, available, require
from tpprobe.engines.sglang import layer_ids as lid
from tpprobe.engines.sglang.tiny_archs import SGLANG_CLASSES, arch_of, canonical_arch, check_tp, config_for
from tpprobe.engines.sglang.tiny_weights import seeded_hf_model, seeded_input_ids, unfuse_experts


@dataclass
class _Runtime:
    model: Any
    config: Any
    ids: torch.Tensor
    dtype: torch.dtype
    mla: bool
    capture: bool
    attn_dp: int = 1


def extend_batch(rt: _Runtime, seqs: Optional[list] = None):
    """An EXTEND ForwardBatch of `seqs` (default: the probe's one prompt), packed one after the
    other as SGLang's scheduler packs a prefill batch: request i owns row i+1 of the req->token
    table and KV slots after request i-1's (row 0 / slot 0 are the padding row and slot)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import (MHATokenToKVPool, MLATokenToKVPool,
                                                  ReqToTokenPool)
    from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                              ForwardMode)

    seqs = [rt.ids] if seqs is None else list(seqs)
    lens = [int(x.numel()) for x in seqs]
    ids = torch.cat(seqs)
    n, b = int(ids.numel()), len(seqs)
    L = rt.config.num_hidden_layers
    size = n + 8
    req_pool = ReqToTokenPool(size=b, max_context_len=max(lens) + 8, device="cpu",
                              enable_memory_saver=False)
    if rt.mla:
        attn = rt.model.model.layers[0].self_attn
        kv_pool = MLATokenToKVPool(size=size, page_size=1, dtype=rt.dtype,
                                   kv_lora_rank=attn.kv_lora_rank,
                                   qk_rope_head_dim=attn.qk_rope_head_dim, layer_num=L,
                                   device="cpu", enable_memory_saver=False)
    else:
        attn = rt.model.model.layers[0].self_attn
        kv_pool = MHATokenToKVPool(size=size, page_size=1, dtype=rt.dtype,
                                   head_num=attn.num_kv_heads, head_dim=attn.head_dim,
                                   layer_num=L, device="cpu", enable_memory_saver=False,
                                   enable_alt_stream=False)
    locs = torch.arange(1, n + 1, dtype=torch.int64)  # slot 0 is the padding slot
    req_idx = torch.arange(1, b + 1)                   # row 0 is the padding row
    start = 0
    for i, m in enumerate(lens):
        req_pool.req_to_token[i + 1, :m] = locs[start:start + m].to(req_pool.req_to_token.dtype)
        start += m
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    backend = TorchNativeAttnBackend(runner)
    if rt.mla:
        backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=b, input_ids=ids,
        req_pool_indices=req_idx, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=locs, seq_lens_sum=n,
        positions=torch.cat([torch.arange(m, dtype=torch.int64) for m in lens]))
    fb.extend_prefix_lens = torch.zeros(b, dtype=torch.int32)
    fb.extend_prefix_lens_cpu = [0] * b
    fb.extend_seq_lens = seq_lens.clone()
    fb.extend_seq_lens_cpu = list(lens)
    fb.extend_num_tokens = n
    if rt.attn_dp > 1:
        # DP attention: every attention-DP group runs the same n tokens (replicated batch), so
        # every rank's capture is comparable; the FFN gathers the groups' rows (SUM_LEN padding)
        from sglang.srt.layers.dp_attention import DpPaddingMode, set_dp_buffer_len_from_batch

        fb.global_num_tokens_cpu = [n] * rt.attn_dp
        fb.global_num_tokens_gpu = torch.tensor(fb.global_num_tokens_cpu, dtype=torch.int64)
        fb.global_num_tokens_for_logprob_cpu = list(fb.global_num_tokens_cpu)
        fb.global_num_tokens_for_logprob_gpu = fb.global_num_tokens_gpu.clone()
        fb.global_dp_buffer_len = n * rt.attn_dp
        fb.dp_padding_mode = DpPaddingMode.SUM_LEN
        fb.is_extend_in_batch = True
        set_dp_buffer_len_from_batch(fb)
    # FULL: the logits processor returns the (aux) hidden states of every token
    fb.capture_hidden_mode = CaptureHiddenMode.FULL if rt.capture else CaptureHiddenMode.NULL
    return fb, backend


def _run(rt: _Runtime, seqs: Optional[list] = None):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fb, backend = extend_batch(rt, seqs)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        return rt.model(fb.input_ids, fb.positions, fb)


def packed_aux(result) -> Optional[torch.Tensor]:
    """The packed aux tensor [tokens, K*hidden] SGLang hands the EAGLE-3 draft (None: no capture)."""
    aux = getattr(result, "hidden_states", None)
    if aux is None:
        return None
    if not isinstance(aux, torch.Tensor):
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

        aux = pack_aux_hidden_states(aux)
    return aux


# what every rank's build_target imports (SGLang's model stack: ~7 s of CPU a rank)
_RANK_IMPORTS = ("sglang.srt.distributed.parallel_state", "sglang.srt.runtime_context", "sglang.srt.server_args",
                 "sglang.srt.model_loader.utils", "sglang.srt.layers.attention.torch_native_backend",
                 "sglang.srt.mem_cache.memory_pool", "sglang.srt.model_executor.forward_batch_info",
                 "sglang.srt.model_executor.forward_context", "sglang.srt.layers.dp_attention",
                 "sglang.srt.layers.sampler", "sglang.srt.model_executor.runner", "torch.utils.cpp_extension")


def preload(arch: Optional[str]) -> None:
    """Import, once, what each rank would import, in a launcher that forks its ranks (tpprobe.probe.launch):
    imports only, no tensor, no thread, no distributed state. Best effort: a rank that finds a module
    missing imports it itself, and says why then."""
    if not available():
        return
    import importlib

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    arch = canonical_arch(arch)
    names = [*_RANK_IMPORTS, *([f"sglang.srt.models.{SGLANG_CLASSES[arch][0]}"] if arch in SGLANG_CLASSES else [])]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            return
    import transformers  # noqa: F401   (the seeded HF model every rank builds its weights from)


def build_target(ctx: RankContext, arch: str, num_layers: int, tokens: int, seed: int,
                 dtype: torch.dtype, layer_ids: Optional[list[int]],
                 config_path: Optional[str] = None, moe: bool = True, attn_dp: int = 1,
                 num_experts: Optional[int] = None, vocab: Optional[int] = None,
                 weights_dir: Optional[str] = None) -> ProbeTarget:
    """A tiny SGLang model on this rank, ready for the probe (see the module docstring).

    `weights_dir`: an HF folder (config.json, *.safetensors) whose weights are loaded instead of the seeded
    ones (its config unless `config_path` says another; e.g. tpprobe.engines.vllm.planted's target).
    Needs torch.distributed already initialized with world size = tp (ctx.world_size).
    """
    require()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"--dtype {dtype} is not supported by the SGLang backend "
                         f"(float32, bfloat16, float16)")
    if tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {tokens}")
    config = config_for(arch, num_layers, config_path or weights_dir, moe, num_experts, vocab)
    arch = arch_of(config)
    capture = layer_ids is None or len(layer_ids) > 0
    plan = lid.plan(arch, layer_ids, num_layers) if capture else None
    if plan is not None and plan.crash:
        given = "default" if layer_ids is None else ",".join(map(str, layer_ids))
        raise UsageError(f"layer ids {given} crash SGLang's {arch} forward ({plan.crash}); see "
                         f"`tpprobe layers --arch {arch} --ids {given} --num-layers {num_layers}`")
    check_tp(arch, config_path, ctx.world_size, attn_dp, num_experts)     # validate() said it before any rank

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from tpprobe.engines.sglang.dist import publish_for

    publish_for(ctx, attn_dp)
    if attn_dp > 1:
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer

        init_dp_gathered_buffer(SimpleNamespace(hf_config=config, hidden_size=config.hidden_size,
                                                dtype=dtype))
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    if weights_dir:
        weights = [(k, v.to(dtype)) for k, v in folder_weights(weights_dir).items()]
    else:
        hf = seeded_hf_model(config, seed)
        weights = [(k, v.to(dtype)) for k, v in hf.state_dict().items()]
        del hf
    if arch == "qwen3_moe":
        weights = unfuse_experts(weights)
    vocab = config.vocab_size
    config.dtype = dtype
    if weights_dir:
        import os
        config._name_or_path = os.path.abspath(str(weights_dir))      # where it was loaded from, as a server's
    import importlib

    module, cls_name = SGLANG_CLASSES[arch]
    mod = importlib.import_module(f"sglang.srt.models.{module}")
    named = (getattr(config, "architectures", None) or [None])[0]
    # the class the config names when that module has it (DeepseekV3ForCausalLM for a DeepSeek-V3 / Kimi text model)
    Cls = getattr(mod, named) if isinstance(named, str) and isinstance(getattr(mod, named, None), type) \
        else getattr(mod, cls_name)
    with set_default_torch_dtype(dtype):
        model = Cls(config).eval()
    model.load_weights(weights)
    del weights
    if capture:
        model.set_eagle3_layers_to_capture(layer_ids)
    rt = _Runtime(model=model, config=config, ids=seeded_input_ids(vocab, tokens, seed), dtype=dtype,
                  mla=arch == "deepseek_v2", capture=capture, attn_dp=attn_dp)
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    wrapper = None
    if config_path:
        from tpprobe.config.hub import try_read
        hub = try_read(config_path)
        wrapper = hub.wrapper if hub is not None else None
    info = {
        "backend": f"sglang {SGLANG_VERSION} (CPU test mode, torch_native attention, EXTEND)",
        "model": f"{type(model).__name__} ({'config ' + config_path if config_path else 'tiny'}, "
                 + (f"weights of {weights_dir})" if weights_dir else f"random weights, seed {seed})")
                 + (f", the text model of {wrapper}" if wrapper else ""),
        "vocab": vocab,
        "mlp per layer": ",".join(mlps),
        "sglang layers_to_capture": list(model.model.layers_to_capture) if capture else "off",
        "layer-id rule": plan.rule if plan else "capture off",
    }
    if attn_dp > 1:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        info.update({"attn_dp": attn_dp, "attn_tp": par.attn_tp_size,
                     "dp attention": f"{attn_dp} attention-DP groups of {par.attn_tp_size} ranks "
                                     f"(attention_tp), FFN over tp:0; every group runs the same tokens"})
    # `model.layers`, as the built-in model has them (readers of a target use it); SGLang keeps them
    # at model.model.layers. A plain (unregistered) alias: named_modules/state_dict are unchanged.
    model.__dict__.setdefault("layers", model.model.layers)
    from tpprobe.engines.sglang.stream import sglang_extensions

    return ProbeTarget(
        model=model, forward=lambda: _run(rt), input_ids=rt.ids, num_layers=num_layers,
        hidden_size=config.hidden_size, dtype=dtype, arch=arch,
        packed_aux=packed_aux if capture else None,
        model_layer_ids=None if layer_ids is None else list(layer_ids), info=info,
        # SGLang 0.5.23 layers return an owed output, not the stream: record layer.K.out where
        # SGLang materializes it (tpprobe.engines.sglang.stream)
        tap_extensions=sglang_extensions(), stream_from_layer_output=False,
        forward_batch=lambda seqs: _run(rt, seqs))


def folder_weights(folder) -> dict:
    """Every tensor of an HF folder's *.safetensors (safetensors only: never a pickle)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UsageError(f"{folder}: no *.safetensors to load weights from")
    out: dict = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


__all__ = ["build_target", "extend_batch", "folder_weights", "packed_aux", "preload"]
