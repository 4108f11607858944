"""Tiny random-weight SGLang models on CPU gloo: `tpprobe probe --backend sglang --arch ...`.

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

`hf_reference(...)` recomputes the same seeded weights in HF transformers and returns HF's
per-layer hidden states (hidden_states[0] = embeddings, [i] = input of layer i), so tests can
prove what each aux slot holds.

CPU only: this module enables `tpprobe.engines.sglang.cpu_mode`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch

from tpprobe.engines.sglang import layer_ids as lid
from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang import INSTALL_HINT, SGLANG_VERSION, available, require
from tpprobe.core.target import ProbeTarget, RankContext

ARCHES = ("llama", "deepseek_v2", "qwen3", "qwen3_moe", "qwen2")

# HF model_type -> tpprobe arch
_MODEL_TYPES = {"llama": "llama", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2",
                "kimi_k2": "deepseek_v2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2": "qwen2"}
# tpprobe arch -> (SGLang model module, SGLang class)
_SGLANG_CLASSES = {"llama": ("llama", "LlamaForCausalLM"),
                   "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
                   "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                   "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                   "qwen2": ("qwen2", "Qwen2ForCausalLM")}
# arch -> names accepted by --arch (SGLang's class / HF model_type aliases)
ARCH_ALIASES = {"llamaforcausallm": "llama", "deepseek_v3": "deepseek_v2", "kimi_k2": "deepseek_v2",
                "kimi": "deepseek_v2", "deepseekv2forcausallm": "deepseek_v2",
                "deepseekv3forcausallm": "deepseek_v2", "qwen3forcausallm": "qwen3",
                "qwen3moeforcausallm": "qwen3_moe", "qwen2forcausallm": "qwen2"}


def canonical_arch(arch: Optional[str]) -> Optional[str]:
    """--arch as given -> the tiny-model arch (llama, deepseek_v2, qwen3, qwen3_moe, qwen2)."""
    if arch is None:
        return None
    a = arch.strip().lower().replace("-", "_")
    return ARCH_ALIASES.get(a, a)


def _read_config(config_path: str) -> Optional[dict]:
    path = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def config_arch_and_layers(config_path: str) -> tuple[Optional[str], Optional[int]]:
    """(tiny-model arch, num_hidden_layers) a config.json names: the arch from its `architectures`
    (DeepseekV3ForCausalLM -> deepseek_v2) or its model_type; None for what it does not name (or a
    file that cannot be read: building the model then says what is wrong with it). UsageError for
    an architecture the SGLang backend does not build."""
    d = _read_config(config_path)
    if d is None:
        return None, None
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    L = d.get("num_hidden_layers", text.get("num_hidden_layers"))
    L = L if isinstance(L, int) and not isinstance(L, bool) and L >= 1 else None
    archs = d.get("architectures") if isinstance(d.get("architectures"), list) else []
    for a in archs:
        if isinstance(a, str) and canonical_arch(a) in ARCHES:
            return canonical_arch(a), L
    mt = d.get("model_type")
    if mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt], L
    if archs or mt:
        named = archs[0] if archs else mt
        raise UsageError(f"--config {config_path} is a {named} model (model_type {mt!r}); the SGLang backend builds "
                         f"{', '.join(ARCHES)} (`tpprobe layers --arch {named}` says what its EAGLE-3 ids capture)")
    return None, L


# the tiny models' shapes (tiny_config); validate() checks them against the TP size before any rank starts.
# 8 attention heads everywhere, so every tiny model splits over tp 1, 2, 4 and 8 (Kimi-K2's serving shape);
# 4 KV heads are replicated at tp 8 as SGLang does for any tp over the KV heads; 8 experts, since SGLang's
# MoE refuses a tp over the number of experts.
TINY_SHAPES = {
    "llama": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen2": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen3": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen3_moe": {"heads": 8, "kv_heads": 4, "ffn": 128, "moe_ffn": 32, "experts": 8},
    "deepseek_v2": {"heads": 8, "ffn": 128, "moe_ffn": 32, "experts": 8},     # MLA: no KV heads to split
}


def shape_of(arch: str, config_path: Optional[str] = None) -> dict:
    """The sizes tensor parallelism splits, for the tiny model of `arch` or a config.json."""
    if not config_path:
        return dict(TINY_SHAPES[arch])
    d = _read_config(config_path) or {}
    if isinstance(d.get("text_config"), dict):
        d = {**d["text_config"], **d}
    out = {}
    for key, names in (("heads", ("num_attention_heads",)), ("kv_heads", ("num_key_value_heads",)),
                       ("ffn", ("intermediate_size",)), ("moe_ffn", ("moe_intermediate_size",)),
                       ("experts", ("n_routed_experts", "num_experts", "num_local_experts"))):
        v = next((d[n] for n in names if isinstance(d.get(n), int) and d[n] > 0), None)
        if v is not None:
            out[key] = v
    if arch == "deepseek_v2":
        out.pop("kv_heads", None)        # MLA: the latent KV is not split over ranks
    return out


def check_tp(arch: str, config_path: Optional[str], tp: int, attn_dp: int = 1) -> None:
    """UsageError (one line, what to pass) when the model's heads / KV heads / MLP widths do not
    split over `tp` ranks (attention over tp / attn_dp); runs before any rank starts."""
    shape = shape_of(arch, config_path)
    attn_tp = max(tp // max(attn_dp, 1), 1)

    def fits(t: int, a: int) -> list[str]:
        bad = []
        if "heads" in shape and shape["heads"] % a:
            bad.append(f"its {shape['heads']} attention heads do not split over {a} ranks")
        kv = shape.get("kv_heads")
        if kv and kv % a and a % kv:
            bad.append(f"its {kv} KV heads neither split over nor replicate onto {a} ranks")
        for key, what in (("ffn", "MLP width"), ("moe_ffn", "expert MLP width")):
            if key in shape and shape[key] % t:
                bad.append(f"its {what} {shape[key]} does not split over {t} ranks")
        if "experts" in shape and t > shape["experts"]:
            bad.append(f"its {shape['experts']} experts are fewer than the {t} ranks (SGLang's MoE refuses that)")
        return bad

    bad = fits(tp, attn_tp)
    if bad:
        model = f"--config {config_path}" if config_path else f"--arch {arch}"
        ok = [t for t in range(1, 65) if not fits(t, t)]
        dp = f" --dp-attention {attn_dp}" if attn_dp > 1 else ""
        raise UsageError(f"{model} at tp={tp}{dp}: {'; '.join(bad)}; use --nproc "
                         f"{', '.join(map(str, ok[:-1])) + ' or ' + str(ok[-1]) if len(ok) > 1 else ok[0]}")


def default_layer_ids(arch: str, num_layers: int) -> list[int]:
    """The probe's default ids for `arch`: those that capture the embedding and the streams leaving
    layers 1 and 3 (HF hidden_states[0], [2], [4]) under that architecture's SGLang rule, i.e.
    -1,1,3 where SGLang adds +1 (Llama, Qwen) and 0,2,4 where it uses the ids as given
    (DeepSeek: +1 only when the first id is 1). Shorter for models of fewer layers."""
    L = int(num_layers)
    arch = canonical_arch(arch) or "llama"
    cands = [[i for i in (-1, 1, 3) if i < L - 1], [i for i in (0, 2, 4) if i < L]]
    # the pinned rule of the tiny model's family, so the launcher needs no sglang import; each rank
    # then checks the ids against the rule derived from SGLang (build_target refuses a crash)
    family = "deepseek_v2" if arch == "deepseek_v2" else "llama"
    for ids in cands:
        if ids and not lid.pinned_plan(family, ids, L).problems:
            return ids
    return cands[0] or [-1]


def tiny_config(arch: str, num_layers: int, moe: bool = True):
    """The built-in tiny config (float32) for `arch`."""
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32",
            architectures=["LlamaForCausalLM"])
    common = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float32")
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=8, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # every layer MoE: SGLang 0.5.23's Qwen3-MoE ignores mlp_only_layers (qwen3_moe.py:878)
        return Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=32,
                              num_experts=TINY_SHAPES["qwen3_moe"]["experts"],
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    if arch == "deepseek_v2":
        from transformers import DeepseekV3Config

        c = DeepseekV3Config(
            vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=num_layers, num_attention_heads=TINY_SHAPES["deepseek_v2"]["heads"],
            num_key_value_heads=TINY_SHAPES["deepseek_v2"]["heads"],
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=TINY_SHAPES["deepseek_v2"]["experts"],
            n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=_first_dense(num_layers, moe),
            max_position_embeddings=256,
            # SGLang's CPU rope supports only deepseek_yarn (as real DeepSeek-V3 uses)
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                             "original_max_position_embeddings": 128, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            tie_word_embeddings=False, dtype="float32", rms_norm_eps=1e-6)
        c.architectures = ["DeepseekV3ForCausalLM"]
        return c
    raise UsageError(f"--arch {arch!r} is not supported by the SGLang backend: "
                     f"use one of {', '.join(ARCHES)}")


def _first_dense(num_layers: int, moe: bool) -> int:
    # moe: layer 0 dense, the rest MoE (one layer alone is made MoE); else all dense
    return (1 if num_layers >= 2 else 0) if moe else num_layers


def load_config(arch: Optional[str], config_path: str, num_layers: int, moe: bool = True):
    """A user's config.json (file or its folder) cut to `num_layers` layers, for random weights."""
    path = config_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {config_path}: cannot read a JSON config ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise UsageError(f"--config {config_path}: no 'model_type' in it; expected a HF config.json")
    mt = d["model_type"]
    if mt not in _MODEL_TYPES:
        raise UsageError(f"--config {config_path}: model_type {mt!r} is not supported by the SGLang "
                         f"backend (supported: {', '.join(sorted(_MODEL_TYPES))})")
    if arch is not None and _MODEL_TYPES[mt] != arch:
        raise UsageError(f"--config {config_path} is a {mt} model but --arch is {arch}: "
                         f"use --arch {_MODEL_TYPES[mt]}")
    for drop in ("quantization_config", "auto_map", "_name_or_path"):
        d.pop(drop, None)  # random weights in the probe dtype; never run remote code
    if mt == "kimi_k2":
        mt = d["model_type"] = "deepseek_v3"
    d["num_hidden_layers"] = num_layers
    if _MODEL_TYPES[mt] == "deepseek_v2":
        d["first_k_dense_replace"] = min(int(d.get("first_k_dense_replace", 0)),
                                         _first_dense(num_layers, moe))
        d.pop("num_nextn_predict_layers", None)
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(**d)
    except Exception as e:  # noqa: BLE001 - transformers' own validation, one line for the user
        raise UsageError(f"--config {config_path}: transformers rejects it: {e}") from None
    c.num_hidden_layers = num_layers
    return c


def _arch_of(config) -> str:
    return _MODEL_TYPES[config.model_type]


def _hf_class(config):
    import transformers

    name = {"llama": "LlamaForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM"}[config.model_type]
    return getattr(transformers, name)


def seeded_hf_model(config, seed: int):
    """HF model of `config` with weights drawn from `seed` only (identical on every rank)."""
    torch.manual_seed(seed)
    hf = _hf_class(config)(config).eval().float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            if p.dim() > 1:   # non-trivial but bounded activations for any width
                p.normal_(0.0, min(0.2, 1.5 / math.sqrt(p.shape[-1])), generator=g)
            else:             # norms etc. away from 1 so a skipped norm is visible
                p.uniform_(0.5, 1.5, generator=g)
    return hf


def _input_ids(vocab: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed + 1))


def hf_reference(arch: str, num_layers: int, tokens: int, seed: int,
                 config_path: Optional[str] = None, moe: bool = True, prenorm_last: bool = False):
    """HF transformers' forward on the same seeded weights and input ids as `build_target`.

    Returns (input_ids [tokens], hidden_states: list of L+1 tensors [tokens, hidden] with
    hidden_states[0] = embedding output and hidden_states[i] = input of decoder layer i
    (the last one is after the final norm, as HF returns it; with prenorm_last=True it is the
    stream leaving the last layer BEFORE the final norm, i.e. what tpprobe's layer.{L-1}.out is),
    logits [tokens, vocab]); all float32.
    """
    config = _config(arch, num_layers, config_path, moe)
    hf = seeded_hf_model(config, seed)
    ids = _input_ids(config.vocab_size, tokens, seed)
    grabbed = {}
    h = hf.model.norm.register_forward_pre_hook(lambda m, a: grabbed.setdefault("x", a[0].detach().clone()))
    try:
        with torch.no_grad():
            out = hf(ids[None], output_hidden_states=True)
    finally:
        h.remove()
    hs = [x[0] for x in out.hidden_states]
    if prenorm_last:
        hs[-1] = grabbed["x"][0]
    return ids, hs, out.logits[0]


def _config(arch, num_layers, config_path, moe):
    arch = canonical_arch(arch)
    if arch is not None and arch not in ARCHES:
        raise UsageError(f"--arch {arch!r} is not supported by the SGLang backend: "
                         f"use one of {', '.join(ARCHES)}")
    if num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    if config_path:
        config = load_config(arch, config_path, num_layers, moe)
    else:
        if arch is None:
            raise UsageError("--arch or --config is needed for the SGLang backend")
        config = tiny_config(arch, num_layers, moe)
    if _arch_of(config) == "deepseek_v2":
        from tpprobe.engines.sglang.cpu_mode import fill_deepseek_config

        fill_deepseek_config(config)
    return config


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


def unfuse_experts(weights):
    """transformers 5 stores an MoE block's experts fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); SGLang's Qwen3-MoE load_weights reads one checkpoint tensor per
    expert (experts.{e}.gate_proj/up_proj/down_proj.weight), as real checkpoints have them."""
    out = []
    for k, v in weights:
        if k.endswith(".mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", v[e, :inter].contiguous()),
                        (f"{base}{e}.up_proj.weight", v[e, inter:].contiguous())]
        elif k.endswith(".mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", v[e].contiguous()) for e in range(v.shape[0])]
        else:
            out.append((k, v))
    return out


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
    names = [*_RANK_IMPORTS, *([f"sglang.srt.models.{_SGLANG_CLASSES[arch][0]}"] if arch in _SGLANG_CLASSES else [])]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            return
    import transformers  # noqa: F401   (the seeded HF model every rank builds its weights from)


def build_target(ctx: RankContext, arch: str, num_layers: int, tokens: int, seed: int,
                 dtype: torch.dtype, layer_ids: Optional[list[int]],
                 config_path: Optional[str] = None, moe: bool = True, attn_dp: int = 1) -> ProbeTarget:
    """A tiny SGLang model on this rank, ready for the probe (see the module docstring).

    Needs torch.distributed already initialized with world size = tp (ctx.world_size).
    """
    require()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"--dtype {dtype} is not supported by the SGLang backend "
                         f"(float32, bfloat16, float16)")
    if tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {tokens}")
    config = _config(arch, num_layers, config_path, moe)
    arch = _arch_of(config)
    capture = layer_ids is None or len(layer_ids) > 0
    plan = lid.plan(arch, layer_ids, num_layers) if capture else None
    if plan is not None and plan.crash:
        given = "default" if layer_ids is None else ",".join(map(str, layer_ids))
        raise UsageError(f"layer ids {given} crash SGLang's {arch} forward ({plan.crash}); see "
                         f"`tpprobe layers --arch {arch} --ids {given} --num-layers {num_layers}`")
    check_tp(arch, config_path, ctx.world_size, attn_dp)     # validate() said it before any rank started

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from tpprobe.engines.sglang.dist import publish_for

    publish_for(ctx, attn_dp)
    if attn_dp > 1:
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer

        init_dp_gathered_buffer(SimpleNamespace(hf_config=config, hidden_size=config.hidden_size,
                                                dtype=dtype))
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    hf = seeded_hf_model(config, seed)
    weights = [(k, v.to(dtype)) for k, v in hf.state_dict().items()]
    if arch == "qwen3_moe":
        weights = unfuse_experts(weights)
    vocab = config.vocab_size
    del hf
    config.dtype = dtype
    import importlib

    module, cls_name = _SGLANG_CLASSES[arch]
    Cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls_name)
    with set_default_torch_dtype(dtype):
        model = Cls(config).eval()
    model.load_weights(weights)
    del weights
    if capture:
        model.set_eagle3_layers_to_capture(layer_ids)
    rt = _Runtime(model=model, config=config, ids=_input_ids(vocab, tokens, seed), dtype=dtype,
                  mla=arch == "deepseek_v2", capture=capture, attn_dp=attn_dp)
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    info = {
        "backend": f"sglang {SGLANG_VERSION} (CPU test mode, torch_native attention, EXTEND)",
        "model": f"{type(model).__name__} ({'config ' + config_path if config_path else 'tiny'}, "
                 f"random weights, seed {seed})",
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
    # tpprobe.builtin.faults.apply reads `model.layers` even when nothing is injected; SGLang keeps them
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


__all__ = ["build_target", "hf_reference", "packed_aux", "tiny_config", "load_config",
           "seeded_hf_model", "ARCHES", "INSTALL_HINT"]
