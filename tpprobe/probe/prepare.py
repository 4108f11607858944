"""Before the forward: the options checked (`validate`, also before any process starts) and the
model each rank probes built (`build_target`: a user's --model factory, SGLang's tiny model, or
the built-in one)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Optional

import torch

from ..formats.capture_dir import check_file_path, estimate_capture_bytes
from ..formats.settings import run_settings
from ..core.errors import TPProbeError, UsageError
from ..builtin.faults import check_backend, parse as parse_faults
from ..builtin.model import BuiltinConfig
from ..config.options import ProbeOptions
from ..core.target import ProbeTarget, RankContext


def validate(opts: ProbeOptions, world: int) -> None:
    """Everything that can be checked before any process starts; raises UsageError."""
    _ = opts.torch_dtype
    if world < 1:
        raise UsageError(f"--nproc must be >= 1 (got {world})")
    if opts.max_bytes <= 0:
        raise UsageError(f"--max-bytes must be > 0 (got {opts.max_bytes:g})")
    if opts.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds (got {opts.timeout})")
    if opts.exchange not in ("full", "fingerprint"):
        raise UsageError(f"unknown --exchange {opts.exchange!r}: use full or fingerprint")
    if opts.backend not in ("auto", "gloo", "nccl", "sglang", "vllm"):
        raise UsageError(f"unknown --backend {opts.backend!r}: use auto, gloo, nccl, sglang or vllm")
    from ..engines.sglang.tiny_archs import ARCHES as SGLANG_ARCHES, canonical_arch
    if opts.backend == "vllm":
        _validate_vllm(opts, world)
    elif canonical_arch(opts.arch) not in SGLANG_ARCHES:   # the tiny SGLang models tpprobe builds
        raise UsageError(f"unknown --arch {opts.arch!r}: use {', '.join(SGLANG_ARCHES)} (with --backend sglang)")
    if opts.config is not None and opts.backend not in ("sglang", "vllm"):
        raise UsageError(f"--config {opts.config} builds SGLang's model classes: add --backend sglang "
                         f"(the built-in model takes --num-layers/--hidden/--heads/--ffn/--vocab instead)")
    check_config_file(opts.config)          # before any engine is imported (seconds, not tens of them)
    if opts.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs a CUDA device on every rank; use --backend gloo on CPU")
    if opts.num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1 (got {opts.num_layers})")
    for flag, path in (("--html", opts.html), ("--markdown", opts.markdown)):
        if path:
            check_file_path(Path(path), flag)
    ids = opts.layers
    if len(set(ids)) != len(ids):
        raise UsageError(f"--layers has duplicate ids {ids}: each layer id once")
    if not ids:
        raise UsageError("--layers is empty: give ids like -1,1,3 (-1 = the embedding)")
    if opts.model is None:
        bad = [i for i in ids if i < -1 or i >= opts.num_layers]
        if bad:
            raise UsageError(f"--layers {bad} out of range for a model of {opts.num_layers} layers: "
                             f"ids run from -1 (embedding) to {opts.num_layers - 1}")
        if opts.backend not in ("sglang", "vllm"):
            BuiltinConfig.from_options(opts).validate(world)
    if opts.model is not None and ":" not in opts.model:
        raise UsageError(f"--model {opts.model!r} must be package.module:factory")
    check_backend(opts.inject, opts.backend, opts.model)
    _validate_dp_attention(opts, world)
    if opts.backend == "sglang" and opts.model is None:   # shapes before any rank starts, not after a build
        from ..engines.sglang.tiny_archs import check_tp
        check_tp(canonical_arch(opts.arch), opts.config, world, opts.dp_attention, opts.num_experts)
    parse_faults(opts.inject, world, opts.num_layers, ids)
    if opts.config and opts.backend in ("sglang", "vllm") and opts.model is None:
        check_memory(opts, world)


def check_memory(opts: ProbeOptions, world: int) -> None:
    """Refuse, before any rank starts, a --config model this machine cannot hold (tpprobe.engines.footprint):
    in the launcher, for every rank it is about to start; under torchrun, on each node's local rank 0
    for the node's ranks."""
    import os

    from ..config.hub import read_config
    from ..engines.footprint import check
    from ..engines.sglang.tiny_archs import canonical_arch
    from ..exchange.dist import BACKEND_ENV, env_rank

    if env_rank() is not None and (BACKEND_ENV in os.environ or os.environ.get("LOCAL_RANK", "0") != "0"):
        return      # tpprobe's own launcher checked before starting the ranks (it passes BACKEND_ENV)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if env_rank() is not None else world
    check(read_config(opts.config), canonical_arch(opts.arch), opts.num_layers, world, opts.dtype, ranks,
          opts.num_experts, opts.vocab_size)


def _validate_vllm(opts: ProbeOptions, world: int) -> None:
    """--backend vllm: the arch it builds, its shapes over tp, and what it does not take yet."""
    from ..engines.vllm.tiny import check_arch, check_tp
    if opts.model is not None:
        raise UsageError("--backend vllm builds vLLM's tiny models; with --model your factory builds the model: "
                         "drop --backend vllm")
    check_tp(check_arch(opts.arch), world, opts.config, opts.num_experts)


def _validate_dp_attention(opts: ProbeOptions, world: int) -> None:
    if opts.dp_attention < 1:
        raise UsageError(f"--dp-attention must be >= 1 (got {opts.dp_attention})")
    if opts.dp_attention > 1:
        if opts.backend != "sglang":
            raise UsageError("--dp-attention runs SGLang's DP attention: add --backend sglang")
        if world % opts.dp_attention or world == opts.dp_attention:
            raise UsageError(f"--dp-attention {opts.dp_attention} needs a tp (--nproc, now {world}) it divides into "
                             f"attention-TP groups of 2 or more ranks, e.g. --nproc 4 --dp-attention 2")
    if "dp-attention-gather" in [f.partition("@")[0] for f in opts.inject]:
        if opts.dp_attention < 2:
            raise UsageError("--inject dp-attention-gather needs DP attention: add --nproc 4 --dp-attention 2")
        if opts.tokens % (world // opts.dp_attention):
            raise UsageError(f"--inject dp-attention-gather splits the tokens over the attention-TP group: use "
                             f"--tokens divisible by {world // opts.dp_attention}")


def build_target(ctx: RankContext, opts: ProbeOptions, layer_ids: list[int]) -> ProbeTarget:
    """The model this rank probes: the user's --model factory, SGLang's tiny model, or the built-in one."""
    if opts.model:
        return user_target(ctx, opts.model)
    if opts.backend == "sglang":
        from ..engines.sglang.tiny import build_target as sglang_target
        return sglang_target(ctx, arch=opts.arch, num_layers=opts.num_layers, tokens=opts.tokens, seed=opts.seed,
                             dtype=opts.torch_dtype, layer_ids=layer_ids, config_path=opts.config,
                             attn_dp=opts.dp_attention, num_experts=opts.num_experts, vocab=opts.vocab_size)
    if opts.backend == "vllm":
        from ..engines.vllm.tiny import build_target as vllm_target
        return vllm_target(ctx, arch=opts.arch, num_layers=opts.num_layers, tokens=opts.tokens, seed=opts.seed,
                           dtype=opts.torch_dtype, layer_ids=layer_ids, config_path=opts.config,
                           num_experts=opts.num_experts, vocab=opts.vocab_size)
    from ..builtin.model import build_builtin
    return build_builtin(ctx, BuiltinConfig.from_options(opts, layer_ids))


def build_with_faults(ctx: RankContext, opts: ProbeOptions) -> tuple[ProbeTarget, list[int]]:
    """The target, broken as --inject asks (faults act on the model, never on the probe), and the
    layer ids it captures (a fault may move them)."""
    from ..builtin import faults
    flt = faults.parse(opts.inject, ctx.world_size, opts.num_layers, opts.layers)
    layer_ids = faults.adjust_layer_ids(flt, list(opts.layers), opts.num_layers)
    groups = faults.prepare_groups(flt, ctx)
    try:
        target = build_target(ctx, opts, layer_ids)
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "allocate" not in str(e) and "out of memory" not in str(e):
            raise
        # a resource limit is bad input: what would not fit and how to shrink it (tpprobe.engines.footprint)
        raise UsageError(f"rank {ctx.rank} ran out of memory building the model ({str(e).splitlines()[0][:120]}); "
                         f"shrink it: --num-experts, --vocab-size, --num-layers (the TP structure stays), or "
                         f"fewer --nproc") from None
    if opts.model:   # a user's model: its own depth bounds the ids
        L = target.num_layers
        if not opts.layers_given:      # the default ids follow the depth, known only now
            from ..config.options import builtin_layer_ids
            opts.layers = layer_ids = builtin_layer_ids(L)
        bad = [i for i in opts.layers if i < -1 or i >= L]
        if bad:
            raise UsageError(f"--layers {bad} out of range for {opts.model} ({L} layers): ids run from -1 "
                             f"(embedding) to {L - 1}")
    faults.apply(flt, target, ctx, groups)
    return target, layer_ids


def capture_size(target: ProbeTarget, layer_ids: list[int], opts: ProbeOptions) -> int:
    """The bytes one rank will write, refused over --max-bytes (as the SGLang plugin's TPPROBE_MAX_BYTES)."""
    est = estimate_capture_bytes(target, layer_ids, opts.exchange == "full")
    if est > opts.max_bytes:
        raise UsageError(f"this probe would write about {est / 1e6:.1f} MB per rank, over --max-bytes "
                         f"{opts.max_bytes:.3g}: use --exchange fingerprint (keeps the requested slots only), "
                         f"fewer --tokens or --layers, or raise --max-bytes")
    return est


def _debugging() -> bool:
    """--debug is on for this run (the ranks get the launcher's argv)."""
    import sys
    return "--debug" in sys.argv


def user_target(ctx: RankContext, spec: str) -> ProbeTarget:
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"--model {spec}: cannot import the module {mod_name!r} ({e}); "
                         f"check the module is on PYTHONPATH") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == mod.__name__)
        raise UsageError(f"--model {spec}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no factory "
                         f"{fn_name!r}{'; it defines ' + ', '.join(names[:8]) if names else ''}")
    try:
        target = fn(ctx)
    except TPProbeError:
        raise
    except Exception as e:
        raise UsageError(f"--model {spec}: the factory raised {type(e).__name__}: {e}"
                         f"{'' if _debugging() else '; run with --debug for the traceback'}") from e
    if not isinstance(target, ProbeTarget):
        raise UsageError(f"--model {spec}: the factory returned {type(target).__name__}, expected "
                         f"tpprobe.ProbeTarget(model=..., forward=..., input_ids=..., ...)")
    if any(type(m).__module__.startswith("sglang.") for m in target.model.modules()):
        import tpprobe.engines.sglang.stream  # noqa: F401  registers SGLang's layer extensions with the Tap
    if any(type(m).__module__.startswith("vllm.") for m in target.model.modules()):
        import tpprobe.engines.vllm.audit  # noqa: F401  registers vLLM's coordinator door with the Tap
    return target


def probe_settings(opts: ProbeOptions, ctx: RankContext, target: ProbeTarget, layer_ids: list[int]) -> dict:
    """The probe's run settings as the report and the manifest show them (formats/settings.py builds them)."""
    shown_ids = target.model_layer_ids if opts.model and target.model_layer_ids is not None else layer_ids
    dtype = str(target.dtype).removeprefix("torch.") if opts.model else opts.dtype   # judge in the model's dtype
    slots = None
    if opts.backend == "vllm" and target.packed_aux is not None:
        # vLLM's rule: slots in ascending id (tpprobe.engines.vllm.tiny)
        from ..engines.vllm.tiny import expected_slots as vllm_slots
        slots = vllm_slots(layer_ids)
    if opts.backend == "sglang" or str(target.info.get("backend", "")).startswith("sglang"):
        # SGLang's capture-id rules per arch (DeepSeek: +1 only when the first id is 1)
        from ..engines.sglang.tiny_archs import ARCHES as SGLANG_ARCHES
        from ..engines.sglang.layer_ids import expected_slots, plan
        if target.arch in SGLANG_ARCHES:
            slots = expected_slots(plan(target.arch, target.model_layer_ids, target.num_layers))
    return run_settings(
        world_size=ctx.world_size, backend=ctx.backend, dtype=dtype, layer_ids=shown_ids,
        requested_layer_ids=list(opts.layers), num_layers=target.num_layers, hidden=target.hidden_size,
        tokens=int(target.input_ids.numel()), arch=target.arch,
        model=opts.model or (f"{opts.backend}:{opts.arch}" if opts.backend in ("sglang", "vllm") else "builtin"),
        inject=list(opts.inject), exchange=opts.exchange, timeout_s=opts.timeout,
        model_packs_aux=target.packed_aux is not None, seed=opts.seed, slots=slots,
        extra={k: v for k, v in target.info.items() if isinstance(v, (int, float, str))})


# ---- said by the launcher before any rank starts and before any engine is imported (SGLang and vLLM take
# tens of seconds to import): a --config that is no JSON config, a default id list the depth shortened
def check_config_file(path: Optional[str]) -> None:
    """--config: a readable JSON object (a HF config.json or its folder), else UsageError in one line."""
    if path is None:
        return
    p = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e}); give a HF config.json or its "
                         f"folder") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--config {path}: cannot read a JSON config ({e}); give a HF config.json") from None
    if not isinstance(d, dict):
        raise UsageError(f"--config {path}: not a JSON object; expected a HF config.json")


def full_default_ids(opts) -> list[int]:
    """The default ids of a deep model of this arch (what a user reads in --help: -1,1,3 or 0,2,4)."""
    from ..config.options import builtin_layer_ids
    if opts.backend == "sglang" or (opts.backend == "vllm" and opts.arch in ("deepseek_v2", "deepseek_v3",
                                                                             "kimi_k2")):
        from ..engines.sglang.tiny_archs import default_layer_ids
        return default_layer_ids(opts.arch, 64)
    return builtin_layer_ids(64)


def default_ids_note(opts) -> Optional[str]:
    """One line when the default ids were cut to fit the model's depth, else None (ids given, or a
    --model factory, whose depth the ranks learn)."""
    if opts.layers_given or opts.model:
        return None
    full = full_default_ids(opts)
    got = list(opts.layers)
    if got == full:
        return None
    n = len(got)
    return (f"tpprobe: note: a {opts.num_layers}-layer model: the default ids are {','.join(map(str, got))} "
            f"({n} slot{'s' if n != 1 else ''}), not {','.join(map(str, full))} ({len(full)} slots): fitted to "
            f"this depth; give --layers to choose")
