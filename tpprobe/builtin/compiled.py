"""The built-in model under torch.compile with the fingerprint taps inside PyTorch's own CUDA graphs.

`compiled_probe_rank` is one rank of the proof (tests/test_compiled_tap.py, `pytest -m gpu`): it builds
the model, injects catalogue faults (before compiling, so they are part of the graph), plans the
`CompiledTaps` in one eager forward, compiles with ``mode="reduce-overhead"`` (Inductor, then
cudagraph trees record and replay) or ``backend="cudagraphs"`` (the same aten kernels as eager, in
cudagraph trees), replays with new input ids, reads the fingerprints written inside the replayed
graph and returns the rank record of them (capture/record.py), the run settings `graph_findings`
judges, and two comparisons:
- ``aux``: the in-graph fingerprint of each EAGLE-3 slot's point against the fingerprint, taken
  after the replay, of the same values the compiled graph returned in its packed aux (equal to the
  bit: the same tensor, fingerprinted inside and outside the graph);
- ``eager``: every point against the same forward run eagerly under the ordinary Tap (equal to
  the bit with the cudagraphs backend; within rounding noise with Inductor, which fuses the
  norms and adds in its own order).
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch

from ..capture.compiled_tap import CompiledTaps
from ..capture.points import EMBED_OUT, id_point
from ..capture.record import Sketch, rank_record
from ..fingerprint.reference import Deferred, resolved, sketch_close
from ..formats.settings import run_settings
from .graph import FP_K, FP_SEED, build_on_device, eager_fingerprints


def compile_model(model: torch.nn.Module, backend: str):
    """torch.compile of the model: "inductor" (mode="reduce-overhead") or "cudagraphs"."""
    if backend == "inductor":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return torch.compile(model, backend="cudagraphs", dynamic=False)


def run_compiled(fast, ids):
    torch.compiler.cudagraph_mark_step_begin()
    return fast(ids)


def compiled_probe_rank(ctx, cfg, faults: list[str], tokens: int, input_seed: int = 123,
                        backend: str = "inductor") -> dict:
    """One rank: build (+ faults), plan the taps, compile, replay new ids, read, compare."""
    from . import faults as faults_mod

    torch._dynamo.reset()
    flt = faults_mod.parse(faults, ctx.world_size, cfg.num_layers, list(cfg.layer_ids))
    layer_ids = faults_mod.adjust_layer_ids(flt, list(cfg.layer_ids), cfg.num_layers)
    groups = faults_mod.prepare_groups(flt, ctx)
    c = dataclasses.replace(cfg, tokens=tokens, layer_ids=layer_ids)
    target = build_on_device(ctx, c)
    faults_mod.apply(flt, target, ctx, groups)
    model = target.model
    g = torch.Generator().manual_seed(input_seed + tokens)
    warm = torch.randint(0, c.vocab, (tokens,), generator=g).to(ctx.device)
    ids = torch.randint(0, c.vocab, (tokens,), generator=g).to(ctx.device)
    with torch.no_grad():
        taps = CompiledTaps(model, warm, seed=FP_SEED, k=FP_K)
        try:
            fast = compile_model(model, backend)
            for _ in range(3):                       # warm-up, record, replay
                run_compiled(fast, warm)
            out = run_compiled(fast, ids)
            packed = out[1].clone() if out[1] is not None else None
            fps, read_at = taps.read(), time.time()
        finally:
            taps.remove()
        aux = aux_against_graph(fps, packed, list(layer_ids), c.hidden)
        etap, _ = eager_fingerprints(model, ids)
    view = copy.copy(taps.tap)
    view.summaries = dict(fps)
    view.allreduces, view.captures = [], {}
    meta = rank_record(view, rank=ctx.rank, world=ctx.world_size, input_ids=None, model=model, hidden=c.hidden,
                       aux=packed, device=ctx.device,
                       extra={"read_at": read_at, "source": f"torch.compile ({backend}) cudagraph replay"},
                       fingerprints=Sketch(FP_SEED, FP_K), slot_dtype=c.dtype, with_coverage=False).to_json()
    eager = {}
    for n, fp in fps.items():
        e = resolved(etap.summaries.get(n))
        eager[n] = {"both": e is not None, "hash_equal": e is not None and e.bit_hash == fp.bit_hash,
                    "close": e is not None and sketch_close(e, fp, c.dtype),
                    "nan": (fp.n_nan, e.n_nan if e is not None else None)}
    settings = run_settings(world_size=ctx.world_size, backend=ctx.backend, dtype=c.dtype, layer_ids=layer_ids,
                            num_layers=c.num_layers, hidden=c.hidden, tokens=tokens, arch="builtin", model="builtin",
                            inject=list(faults), model_packs_aux=True,
                            exchange=f"fingerprint (torch.compile {backend}, CUDA graph)",
                            extra={"compile_backend": backend})
    return {"meta": meta, "aux": aux, "eager": eager, "settings": settings, "points": list(fps),
            "static_bytes": taps.slots.nbytes}


def aux_against_graph(fps: dict, packed, layer_ids: list, hidden: int) -> dict:
    """Each EAGLE-3 slot of the packed aux the compiled graph returned, fingerprinted now, against the
    in-graph fingerprint of its point (the slot of layer id k holds id_point(k), capture/points.py)."""
    if packed is None:
        return {}
    d = Deferred(FP_SEED, FP_K)
    got = {}
    for j, lid in enumerate(layer_ids):
        name = id_point(lid)
        if name not in fps or packed.shape[-1] < (j + 1) * hidden:
            continue
        got[name] = d(packed[..., j * hidden:(j + 1) * hidden].contiguous())
    d.resolve()
    out = {}
    for name, p in got.items():
        a, b = resolved(p), fps[name]
        out[name] = {"equal": a.to_json() == b.to_json(), "embed": name == EMBED_OUT}
    return out
