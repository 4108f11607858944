"""Before the forward: the options completed by their engine (`options_from_cli`), checked (`validate`, also
before any process starts) and the model each rank probes built (`build_target`: the engine's, from
tpprobe.engines.registry: a user's --model factory, SGLang's or vLLM's tiny model, or the built-in one)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..formats.capture_dir import check_file_path, estimate_capture_bytes
from ..formats.settings import run_settings
from ..core.errors import UsageError
from ..engines.builtin.faults import parse as parse_faults
from ..engines import fault_fired, registry
from ..engines.registry import check_faults, engine_of, slot_engine, source
from ..config.knobs import check_numeric_knobs
from ..config.options import BUILTIN, BUILTIN_ONLY, DTYPE_TORCH, ProbeOptions
from ..core.target import ProbeTarget, RankContext


def options_from_cli(**values) -> ProbeOptions:
    """From the typer command's keyword arguments: the options as given, completed by the engine they name
    (tpprobe.engines.registry): its dtype, a --config's architecture and depth, its default ids."""
    kw = ProbeOptions.cli_values(**values)
    model = kw["model"]
    engine = source(kw["engine"], model)
    serving_config = engine.serving and kw["config"]
    if kw["dtype"] is None:
        kw["dtype"] = engine.default_dtype(kw["config"])
    kw["dtype"] = DTYPE_TORCH.get(kw["dtype"], kw["dtype"])    # bf16 -> bfloat16: one name from here on
    given = [f"--{n.replace('_', '-')}" for n in BUILTIN_ONLY if kw.get(n) is not None]
    if given and not engine.builtin_shapes:
        whose = (f"--model {model} builds its own model" if model else
                 f"with --engine {engine.name} the shape comes from --arch or --config (a config.json)")
        shrink = " (--num-experts / --vocab-size / --num-layers shrink a --config model)" \
            if kw["config"] and not model else ""
        raise UsageError(f"{', '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the built-in model only; "
                         f"{whose}: drop {', '.join(given)}"
                         f"{shrink}")
    for n, flag in (("num_experts", "--num-experts"), ("vocab_size", "--vocab-size")):
        if kw.get(n) is not None:
            if not serving_config:
                other = "the built-in model takes --vocab" if n == "vocab_size" else "the built-in has no experts"
                raise UsageError(f"{flag} shrinks a --config model (--engine sglang or vllm --config "
                                 f"config.json); {other}")
            if kw[n] < 1:
                raise UsageError(f"{flag} must be >= 1 (got {kw[n]})")
    for n in ("num_layers", *BUILTIN_ONLY):
        if kw.get(n) is None and not (n == "num_layers" and serving_config):
            kw[n] = BUILTIN[n]
    if kw["config"]:
        from ..config.hub import check_target
        check_target(kw["config"])       # a draft's config read as a target's would probe some other model
    if serving_config:
        # the config's own architecture and depth, unless --arch / --num-layers say otherwise
        arch, layers = engine.config_shape(kw["config"])
        kw["arch"] = kw["arch"] or arch
        if kw["num_layers"] is None:
            kw["num_layers"] = layers or BUILTIN["num_layers"]
    kw["arch"] = kw["arch"] or "llama"
    if not kw["layers_given"] and not model:
        kw["layers"] = engine.default_layer_ids(kw["arch"], kw["num_layers"])
    return ProbeOptions(**kw)


def validate(opts: ProbeOptions, world: int) -> None:
    """Everything that can be checked before any process starts; raises UsageError."""
    check_numeric_knobs()
    _ = opts.torch_dtype
    if world < 1:
        raise UsageError(f"--nproc must be >= 1 (got {world})")
    if opts.max_bytes <= 0:
        raise UsageError(f"--max-bytes must be > 0 (got {opts.max_bytes:g})")
    if opts.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds (got {opts.timeout})")
    if opts.exchange not in ("full", "fingerprint"):
        raise UsageError(f"unknown --exchange {opts.exchange!r}: use full or fingerprint")
    if opts.backend not in ("auto", "gloo", "nccl"):
        raise UsageError(f"unknown --backend {opts.backend!r}: use auto, gloo or nccl")
    named = registry.named(opts.engine)        # an unknown --engine: one line
    engine = engine_of(opts)
    if opts.model is not None:
        named.check_with_model(opts.model)
    engine.check_arch(opts, world)
    if opts.config is not None:
        named.check_config(opts.config)
    check_config_file(opts.config)          # before any engine is imported (seconds, not tens of them)
    if opts.backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs a CUDA device on every rank; use --backend gloo on CPU")
    if opts.num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1 (got {opts.num_layers})")
    for flag, path in (("--html", opts.html), ("--markdown", opts.markdown)):
        if path:
            check_file_path(Path(path), flag, capture=opts.out)    # never over the files this run writes
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
        engine.check_model(opts, world)
    if opts.model is not None and ":" not in opts.model:
        raise UsageError(f"--model {opts.model!r} must be package.module:factory")
    check_faults(engine, [s.partition("@")[0] for s in opts.inject or []])
    _validate_dp_attention(opts, world, named.dp_attention)
    engine.check_tp(opts, world)          # shapes before any rank starts, not after a build
    parse_faults(opts.inject, world, opts.num_layers, ids)
    if opts.config and engine.serving:
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


def _validate_dp_attention(opts: ProbeOptions, world: int, runs_it: bool) -> None:
    if opts.dp_attention < 1:
        raise UsageError(f"--dp-attention must be >= 1 (got {opts.dp_attention})")
    if opts.dp_attention > 1:
        if not runs_it:
            raise UsageError("--dp-attention runs SGLang's DP attention: add --engine sglang")
        if world % opts.dp_attention or world == opts.dp_attention:
            raise UsageError(f"--dp-attention {opts.dp_attention} needs a tp (--nproc, now {world}) it divides into "
                             f"attention-TP groups of 2 or more ranks, e.g. --nproc 4 --dp-attention 2")
    faults = [f.partition("@")[0] for f in opts.inject]
    if opts.dp_attention > 1 and "fused-allreduce-capture" in faults:
        raise UsageError("--inject fused-allreduce-capture does not run under --dp-attention: there SGLang holds a "
                         "layer's owed partial sum in its gathered buffer (the rows of every attention-DP group), not "
                         "in the stream the capture reads; drop --dp-attention to see it")
    if "dp-attention-gather" in faults:
        if opts.dp_attention < 2:
            raise UsageError("--inject dp-attention-gather needs DP attention: add --nproc 4 --dp-attention 2")
        if opts.tokens % (world // opts.dp_attention):
            raise UsageError(f"--inject dp-attention-gather splits the tokens over the attention-TP group: use "
                             f"--tokens divisible by {world // opts.dp_attention}")


def build_target(ctx: RankContext, opts: ProbeOptions, layer_ids: list[int]) -> ProbeTarget:
    """The model this rank probes, as its engine builds it: the user's --model factory, SGLang's or vLLM's
    tiny model, or the built-in one."""
    return engine_of(opts).build(ctx, opts, layer_ids)


def build_with_faults(ctx: RankContext, opts: ProbeOptions) -> tuple[ProbeTarget, list[int]]:
    """The target, broken as --inject asks (faults act on the model, never on the probe), and the
    layer ids it captures (a fault may move them)."""
    from ..engines.builtin import faults
    flt = faults.parse(opts.inject, ctx.world_size, opts.num_layers, opts.layers)
    layer_ids = faults.adjust_layer_ids(flt, list(opts.layers), opts.num_layers)
    groups = faults.prepare_groups(flt, ctx)
    try:
        target = build_target(ctx, opts, layer_ids)
    except AssertionError as e:
        line = engine_assertion(e, opts)
        if line is None:
            raise
        raise UsageError(line) from None
    except (MemoryError, RuntimeError) as e:
        err = out_of_memory(e, opts, ctx.rank, "building the model")
        if err is None:
            raise
        raise err from None
    if opts.model:   # a user's model: its own depth bounds the ids
        L = target.num_layers
        if not opts.layers_given:      # the default ids follow the depth, known only now
            opts.layers = layer_ids = engine_of(opts).default_layer_ids(opts.arch, L)
        bad = [i for i in opts.layers if i < -1 or i >= L]
        if bad:
            raise UsageError(f"--layers {bad} out of range for {opts.model} ({L} layers): ids run from -1 "
                             f"(embedding) to {L - 1}")
    fault_fired.reset()
    for spec, f in zip(opts.inject, flt):    # one at a time, each counted (one that never fires gives no verdict)
        with fault_fired.injecting(spec):
            engine_of(opts).inject([f], target, ctx, groups)
    return target, layer_ids


def engine_assertion(e: AssertionError, opts: ProbeOptions) -> Optional[str]:
    """The one line for an assertion the engine's own code raised building a --config model: the config lacks
    what that code needs (the engine file:line, its condition, the key the config lacks when the condition
    names one); None for any other assertion (tpprobe's own, or the engine's on tpprobe's tiny config)."""
    import linecache
    import os
    import re
    import sys

    engine = engine_of(opts)
    pkg = sys.modules.get(engine.module_prefix.rstrip(".")) if engine.module_prefix else None
    if not opts.config or pkg is None or not getattr(pkg, "__file__", None):
        return None
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    root = os.path.dirname(os.path.abspath(pkg.__file__))
    if not path.startswith(root + os.sep):
        return None
    where = f"{os.path.basename(root)}/{os.path.relpath(path, root)}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
    code = linecache.getline(path, tb.tb_lineno).strip()
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    said = f"`{code}`" + (f" ({msg})" if msg else "") if code.startswith("assert") else (msg or "an assertion")
    m = re.fullmatch(r"assert\s+(?:self\.|config\.)?(\w+)\s+is\s+not\s+None", code)
    try:
        from ..config.hub import read_config
        keys = set(read_config(opts.config).text)
    except Exception:       # the config was read before; a key list is only a better hint
        keys = set()
    lacks = (f"the config has no {m.group(1)!r}, which that code needs: add it as the model's published "
             f"config.json has it" if m and m.group(1) not in keys else
             "the config lacks what that code needs: compare it with the model's published config.json")
    return (f"--config {opts.config}: {engine.title}'s code cannot build this model from it: {where} fails "
            f"{said}; {lacks}")


def out_of_memory(e: BaseException, opts: ProbeOptions, rank: int, doing: str,
                  nproc_helps: bool = True) -> Optional[UsageError]:
    """A resource limit is bad input: the one line saying what would not fit and how to shrink it
    (tpprobe.engines.footprint refuses a --config model before any rank starts); None when `e` is no failed
    allocation. `nproc_helps`: False where the work is not split over the ranks (the unsharded reference)."""
    if not isinstance(e, MemoryError) and "allocate" not in str(e) and "out of memory" not in str(e):
        return None
    shrink = _shrink_options(opts)
    if not nproc_helps:
        shrink = shrink.replace(", or fewer --nproc", "").replace(" or fewer --nproc", "")
    return UsageError(f"rank {rank} ran out of memory {doing} ({_failed_allocation(e)}); shrink it: {shrink}")


def _failed_allocation(e: BaseException) -> str:
    """The allocation that failed, its size whole (torch's own line names it in bytes)."""
    import re

    m = re.search(r"(\d{4,}) bytes", str(e))
    if m:
        return f"an allocation of {int(m.group(1)) / 1e9:.1f} GB failed"
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


def _shrink_options(opts: ProbeOptions) -> str:
    """The options that make this probe's model smaller, as its engine takes them."""
    if opts.model:
        return f"a smaller {opts.model}, or fewer --nproc"
    if opts.config:
        return "--num-experts, --vocab-size, --num-layers (the TP structure stays), or fewer --nproc"
    if engine_of(opts).serving:
        return "--num-layers, or fewer --nproc"
    return "--vocab, --hidden, --ffn, --num-layers, --tokens, or fewer --nproc"


def capture_size(target: ProbeTarget, layer_ids: list[int], opts: ProbeOptions) -> int:
    """The bytes one rank will write, refused over --max-bytes (as the SGLang plugin's TPPROBE_MAX_BYTES)."""
    est = estimate_capture_bytes(target, layer_ids, opts.exchange == "full")
    if est > opts.max_bytes:
        raise UsageError(f"this probe would write about {est / 1e6:.1f} MB per rank, over --max-bytes "
                         f"{opts.max_bytes:.3g}: use --exchange fingerprint (keeps the requested slots only), "
                         f"fewer --tokens or --layers, or raise --max-bytes")
    return est


def probe_settings(opts: ProbeOptions, ctx: RankContext, target: ProbeTarget, layer_ids: list[int]) -> dict:
    """The probe's run settings as the report and the manifest show them (formats/settings.py builds them)."""
    shown_ids = target.model_layer_ids if opts.model and target.model_layer_ids is not None else layer_ids
    dtype = str(target.dtype).removeprefix("torch.") if opts.model else opts.dtype   # judge in the model's dtype
    slots = slot_engine(opts, target).expected_slots(target, layer_ids)
    return run_settings(
        world_size=ctx.world_size, backend=ctx.backend, dtype=dtype, layer_ids=shown_ids,
        requested_layer_ids=list(opts.layers), num_layers=target.num_layers, hidden=target.hidden_size,
        tokens=int(target.input_ids.numel()), arch=target.arch,
        model=engine_of(opts).model_label(opts),
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
    return engine_of(opts).default_layer_ids(opts.arch, 64)


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
