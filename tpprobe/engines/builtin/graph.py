"""The built-in model's forward captured in a CUDA graph with the fingerprint taps inside it.

`GraphedForward` captures `model(static_ids)` in a `torch.cuda.CUDAGraph` (decode-sized batches,
as a serving engine does per batch size) with or without a `GraphTap`; calling it copies new ids
into the static input and replays. `graph_probe_rank` is one rank of the GPU proof: it injects
catalogue faults (before capture, so they are part of the graph), replays with new inputs, reads
the fingerprints after replay, fingerprints the same forward eagerly with the ordinary `Tap` and
compares every point, and returns the rank record (capture/record.py, of the replay's fingerprints) and
the run settings (formats/settings.py) `run_checks` judges (`graph_findings`).
Used by tests/gpu/test_graph_tap.py (`pytest -m gpu`) and bench/graph_decode.py.

`compiled_probe_rank` is the same proof for the model under torch.compile (tests/gpu/test_compiled_tap.py):
catalogue faults injected before compiling, `CompiledTaps` planned in one eager forward, the model
compiled with ``mode="reduce-overhead"`` (Inductor, then cudagraph trees record and replay) or
``backend="cudagraphs"`` (the same aten kernels as eager, in cudagraph trees), replayed with new
ids; besides the record and the settings it returns two comparisons: ``aux``, the in-graph
fingerprint of each EAGLE-3 slot's point against the fingerprint, taken after the replay, of the
same values the compiled graph returned in its packed aux (equal to the bit); ``eager``, every
point against the same forward run eagerly under the ordinary Tap (equal to the bit with the
cudagraphs backend; within rounding noise with Inductor, which fuses norms and adds in its own order).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Optional

import torch

from ...capture.graph_tap import CompiledTaps, GraphTap, StaticFingerprints, replayed
from ...capture.hooks import Tap
from ...capture.points import AUX_PACKED, EMBED_OUT, allreduce_in, allreduce_out, id_point
from ...capture.record import Sketch, rank_record
from ...fingerprint.reference import Deferred, resolved, sketch_close
from ...formats.settings import run_settings

FP_SEED, FP_K = 0, 32


class GraphedForward:
    def __init__(self, model: torch.nn.Module, tokens: int, device, *, taps: bool, warmup: int = 2,
                 vocab: int = 2, side_stream: bool = True):
        self.model = model
        self.ids = torch.randint(0, vocab, (tokens,), device=device, generator=None)
        self.slots: Optional[StaticFingerprints] = \
            StaticFingerprints(device, FP_SEED, FP_K, side_stream=side_stream) if taps else None
        self.tap: Optional[GraphTap] = None
        with torch.no_grad():
            if self.slots is not None:
                with GraphTap(model, self.slots):          # plan: points and shapes, in order
                    model(self.ids)
                self.slots.freeze()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):                  # warm-up: kernels compiled, comms up
                for _ in range(warmup):
                    self._eager_once()
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            tap = GraphTap(model, self.slots) if self.slots is not None else None
            if tap is not None:
                tap.__enter__()
            try:
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    if self.slots is not None:
                        self.slots.begin()
                    self.out = model(self.ids)
                    if self.slots is not None:
                        self.slots.end()
            finally:
                if tap is not None:
                    tap.__exit__(None, None, None)
            self.tap = tap

    def _eager_once(self):
        if self.slots is None:
            return self.model(self.ids)
        with GraphTap(self.model, self.slots):
            self.slots.begin()
            out = self.model(self.ids)
            self.slots.end()
        return out

    def __call__(self, ids: torch.Tensor):
        self.ids.copy_(ids)
        self.graph.replay()
        return self.out

    def read(self) -> Tap:
        """The last replay's fingerprints, as a Tap that ran that forward (capture/graph_tap.replayed)."""
        return replayed(self.tap, self.slots.read())


def eager_fingerprints(model, ids) -> tuple[Tap, object]:
    """The same forward, eager, under the ordinary Tap with the dynamic fingerprint path."""
    from ...fingerprint.reference import fingerprint

    with torch.no_grad(), Tap(model, keep=lambda n: False, keep_allreduce_tensors=False,
                              summarize=lambda t: fingerprint(t, seed=FP_SEED, k=FP_K)) as tap:
        out = model(ids)
    return tap, out


def compare_points(meta: dict, tap: Tap) -> dict:
    """Graph-replay fingerprints against the eager ones: per point, equal hash / equal sketch."""
    eager = {n: f.to_json() for n, f in tap.summaries.items()}
    for a in tap.allreduces:
        eager[allreduce_in(a.seq)], eager[allreduce_out(a.seq)] = a.inp_summary.to_json(), a.out_summary.to_json()
    graph = {n: f for n, f in meta["fingerprints"].items() if n != AUX_PACKED}   # the aux: read after, not a tap
    for a in meta["allreduces"]:
        graph[allreduce_in(a["seq"])], graph[allreduce_out(a["seq"])] = a["in_fp"], a["out_fp"]
    rows = {}
    for n in sorted(set(eager) | set(graph)):
        e, g = eager.get(n), graph.get(n)
        rows[n] = {"both": e is not None and g is not None,
                   "hash_equal": bool(e and g and e["bit_hash"] == g["bit_hash"]),
                   "sketch_equal": bool(e and g and e["sketch"] == g["sketch"]),
                   "rows_equal": bool(e and g and e["row_nonzero"] == g["row_nonzero"])}
    return rows


def device_weights(cfg, device) -> dict:
    """The built-in model's full weights drawn on `device` (seeded: the same on every rank of one
    GPU type); the model's own full_weights draws on the CPU in float32, slow at GPU widths."""
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    h, f = cfg.hidden, cfg.ffn

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(cfg.dtype)

    layers = [{"ln1": 1 + rnd(h, scale=0.1), "ln2": 1 + rnd(h, scale=0.1),
               "qkv": rnd(3 * h, h, scale=h ** -0.5), "o": rnd(h, h, scale=h ** -0.5),
               "gate_up": rnd(2 * f, h, scale=h ** -0.5), "down": rnd(h, f, scale=f ** -0.5)}
              for _ in range(cfg.num_layers)]
    return {"embed": rnd(cfg.vocab, h, scale=cfg.embed_std), "layers": layers, "norm": 1 + rnd(h, scale=0.1)}


def build_on_device(ctx, cfg):
    """`model.build_builtin` with the weights drawn on the rank's device."""
    from .model import TPModel, input_ids
    from ...core.target import ProbeTarget

    cfg.validate(ctx.world_size)
    model = TPModel(device_weights(cfg, ctx.device), ctx, cfg).to(ctx.device).eval()
    ids = input_ids(cfg).to(ctx.device)
    model.set_eagle3_layers_to_capture(cfg.layer_ids)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids, num_layers=cfg.num_layers,
                       hidden_size=cfg.hidden, dtype=cfg.dtype, arch="builtin",
                       packed_aux=lambda result: result[1], model_layer_ids=list(cfg.layer_ids))


def graph_probe_rank(ctx, cfg, faults: list[str], tokens: int, input_seed: int = 123,
                     side_stream: bool = True) -> dict:
    """One rank: build (+ faults), capture with taps, replay new ids, read, compare with eager."""
    from . import faults as faults_mod

    flt = faults_mod.parse(faults, ctx.world_size, cfg.num_layers, list(cfg.layer_ids))
    layer_ids = faults_mod.adjust_layer_ids(flt, list(cfg.layer_ids), cfg.num_layers)
    groups = faults_mod.prepare_groups(flt, ctx)
    c = dataclasses.replace(cfg, tokens=tokens, layer_ids=layer_ids)
    target = build_on_device(ctx, c)
    faults_mod.apply(flt, target, ctx, groups)
    model = target.model
    gf = GraphedForward(model, tokens, ctx.device, taps=True, vocab=c.vocab, side_stream=side_stream)
    g = torch.Generator().manual_seed(input_seed + tokens)
    ids = torch.randint(0, c.vocab, (tokens,), generator=g).to(ctx.device)
    with torch.no_grad():
        out = gf(ids)
        replay, read_at = gf.read(), time.time()
        packed = out[1].clone() if out[1] is not None else None
        etap, _ = eager_fingerprints(model, ids)
    # the rank record every probe writes, of the replay's fingerprints (the aux slots matched against them);
    # no coverage: the hooks ran when the graph was captured, no Python watched this replay
    meta = rank_record(replay, rank=ctx.rank, world=ctx.world_size, input_ids=None, model=model, hidden=c.hidden,
                       aux=packed, device=ctx.device, extra={"read_at": read_at, "source": "cuda-graph replay"},
                       fingerprints=Sketch(FP_SEED, FP_K), slot_dtype=c.dtype, with_coverage=False).to_json()
    cmp = compare_points(meta, etap)
    settings = run_settings(world_size=ctx.world_size, backend=ctx.backend, dtype=c.dtype, layer_ids=layer_ids,
                            num_layers=c.num_layers, hidden=c.hidden, tokens=tokens, arch="builtin", model="builtin",
                            inject=list(faults), model_packs_aux=True, exchange="fingerprint (CUDA graph)",
                            extra={"side_stream": side_stream})
    return {"meta": meta, "compare": cmp, "settings": settings, "slots": len(gf.slots.plans),
            "static_bytes": gf.slots.nbytes}


def graph_findings(metas: dict[int, dict], settings: dict) -> list[dict]:
    """run_checks on the ranks' graph-replay metadata (fingerprints only, as `tpprobe report`)."""
    from ...checks.evidence import FingerprintEvidence
    from ...core.noise import dtype_from_str
    from ...checks.run import run_checks
    from ...formats.capture_dir import LoadedRank

    records = {r: LoadedRank(r, m, {}) for r, m in metas.items()}
    ev = FingerprintEvidence(records, dtype_from_str(settings["dtype"]), {})
    return run_checks(records, settings, evidence=ev)["findings"]

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
