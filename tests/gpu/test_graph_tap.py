"""Fingerprint taps inside a CUDA graph (GPU only: `pytest -m gpu tests/gpu/test_graph_tap.py`).

The built-in model's forward is captured in a torch.cuda.CUDAGraph at decode shapes (1, 8, 64
tokens) with the GraphTap inside it, replayed with NEW input ids, and the fingerprints read after
replay() must equal, for every capture point and every all-reduce input and output, those of the
same forward run eagerly under the ordinary Tap. Catalogue faults injected into the model before
capture must still be named exactly (kind, place, ranks) from the replayed fingerprints. tp 1 runs
in this process; tp 2 runs two processes over NCCL with the all-reduces captured in the graph.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.conftest import needs_gpus

pytestmark = pytest.mark.gpu
# tp 1 on any GPU machine; tp 2 skips, saying why, where there are fewer than 2 GPUs
TPS = [1, pytest.param(2, marks=needs_gpus(2))]

TOKENS = (1, 8, 64)
HEALTHY_TP2_TOKENS = TOKENS
# (inject, tokens, kind, where, ranks) at tp 2 (the catalogue's expectations, tests/ranks/test_faults.py)
TP2_FAULTS = [
    ("skip-embed-allreduce", 8, "partial-allreduce", "embedding (embed_tokens)", [0, 1]),
    ("skip-allreduce@2", 1, "partial-allreduce", "layer 2 (layers.2.self_attn.o_proj)", [0, 1]),
    ("rank-weight@1", 64, "rank-divergence", "layer 3 parameter layers.3.input_layernorm.weight", [1]),
    ("nan@1", 8, "non-finite", "layer.3.out", [1]),
    ("slice-capture", 8, "tp-sliced", "aux.packed", [0, 1]),
    ("capture-offset", 8, "capture-offset", "aux slots [1, 2]", [0, 1]),
    ("drop-embed-slot", 8, "slot-mismatch", "aux slots [0, 1, 2]", [0, 1]),
    ("slot-order", 1, "slot-mismatch", "aux slots [0, 1]", [0, 1]),
    ("alias-capture", 64, "aliased-capture", "aux slots [0, 1, 2]", [0, 1]),
    ("capture-dtype@1", 8, "dtype-mismatch", "aux.packed", [1]),
    ("capture-noncontig", 8, "layout-mismatch", "aux.packed", [0, 1]),
    ("embed-after-norm", 8, "transformed-capture", "aux slot 0", [0, 1]),
    ("drop-last-id", 8, "missing-capture", "aux slot for id 5", [0, 1]),
    ("rank-noise@1", 8, None, None, None),     # 1-2 ULP: rounding noise, no failure
]
TP1_FAULTS = [
    ("nan@0", 8, "non-finite", "layer.3.out", [0]),
    ("slot-order", 8, "slot-mismatch", "aux slots [0, 1]", [0]),
    ("alias-capture", 1, "aliased-capture", "aux slots [0, 1, 2]", [0]),
    ("embed-after-norm", 64, "transformed-capture", "aux slot 0", [0]),
]


def _cfg():
    from tpprobe.engines.builtin.model import BuiltinConfig
    # 6 layers and ids [-1, 1, 3] as the catalogue tests; bf16 as served; Kimi width
    return BuiltinConfig(num_layers=6, hidden=7168, heads=56, ffn=2048, vocab=1000, dtype=torch.bfloat16)


def _failures(findings):
    return [(f["kind"], f["where"], f["ranks"]) for f in findings if f["severity"] == "failure"]


def _cases(tp):
    """(inject, tokens, kind, where, ranks, side_stream): healthy at every decode shape with the
    fingerprints on the forward's stream and on a side stream; faults on the side stream."""
    healthy = [("", t, None, None, None, side) for t in (TOKENS if tp == 1 else HEALTHY_TP2_TOKENS)
               for side in (False, True)]
    return healthy + [(*c, True) for c in (TP1_FAULTS if tp == 1 else TP2_FAULTS)]


def _run_cases(ctx, tp):
    from tpprobe.engines.builtin.graph import graph_probe_rank
    out = []
    for inject, tokens, *_, side in _cases(tp):
        r = graph_probe_rank(ctx, _cfg(), [inject] if inject else [], tokens, side_stream=side)
        out.append(r)
        torch.cuda.synchronize()
    return out


def _worker(rank, world, init_file, q):
    import torch.distributed as dist

    from tpprobe.core.target import RankContext
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        ctx = RankContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cuda", rank),
                          backend="nccl")
        res = _run_cases(ctx, world)
        q.put((rank, [{"meta": r["meta"], "compare": r["compare"], "settings": r["settings"]} for r in res]))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        import traceback
        q.put((rank, "".join(traceback.format_exception(e))))


_RESULTS: dict = {}


def _results(tp):
    if tp in _RESULTS:
        return _RESULTS[tp]
    if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
        pytest.fail(f"needs {tp} CUDA devices (run with -m gpu on the GPU machine)")
    if tp == 1:
        from tpprobe.core.target import RankContext
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), backend="none")
        res = _run_cases(ctx, 1)
        _RESULTS[1] = [{0: r["meta"]} for r in res], [r["compare"] for r in res], [r["settings"] for r in res]
        return _RESULTS[1]
    import torch.multiprocessing as mp
    ctxm = mp.get_context("spawn")
    q = ctxm.Queue()
    init = os.path.join(tempfile.mkdtemp(), "rdzv")
    procs = [ctxm.Process(target=_worker, args=(r, tp, init, q)) for r in range(tp)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(tp):
        rank, v = q.get(timeout=480)
        if isinstance(v, str):
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} failed:\n{v}")
        got[rank] = v
    for p in procs:
        p.join(60)
    n = len(got[0])
    metas = [{r: got[r][i]["meta"] for r in range(tp)} for i in range(n)]
    _RESULTS[tp] = metas, [got[r][i]["compare"] for i in range(n) for r in range(tp)], \
        [got[0][i]["settings"] for i in range(n)]
    return _RESULTS[tp]


@pytest.mark.parametrize("tp", TPS)
def test_graph_replay_fingerprints_equal_eager_at_every_point(tp):
    metas, compares, settings = _results(tp)
    for cmp in compares:
        assert cmp, "no points compared"
        bad = {n: c for n, c in cmp.items() if not (c["both"] and c["hash_equal"] and c["sketch_equal"]
                                                    and c["rows_equal"])}
        assert bad == {}, bad
    # every layer's stream, the embedding and (tp 2) every all-reduce in and out were tapped
    healthy = [(m, s) for m, s in zip(metas, settings) if not s["inject"]]
    assert sorted((s["tokens"], s["side_stream"]) for _, s in healthy) == sorted(
        (t, side) for t in TOKENS for side in (False, True))
    for m, s in healthy:
        names = set(m[0]["fingerprints"])
        assert {"embed.out", "embed.local", *(f"layer.{k}.out" for k in range(6))} <= names
        n_ar = len(m[0]["allreduces"])
        assert n_ar == (0 if tp == 1 else 1 + 2 * 6)
        assert all("in_fp" in a and "out_fp" in a for a in m[0]["allreduces"])


@pytest.mark.parametrize("tp", TPS)
def test_healthy_graph_replay_has_no_findings(tp):
    from tpprobe.engines.builtin.graph import graph_findings
    metas, _, settings = _results(tp)
    for m, s in zip(metas, settings):
        if s["inject"]:
            continue
        findings = graph_findings(m, s)
        assert findings == [] or {f["kind"] for f in findings} == {"rounding-noise"}, findings
        assert _failures(findings) == []


@pytest.mark.parametrize("tp", TPS)
def test_faults_in_the_graphed_model_are_named_exactly(tp):
    from tpprobe.engines.builtin.graph import graph_findings
    metas, _, settings = _results(tp)
    expect = {(c[0], c[1]): c[2:5] for c in _cases(tp) if c[0]}
    seen = 0
    for m, s in zip(metas, settings):
        if not s["inject"]:
            continue
        kind, where, ranks = expect[(s["inject"][0], s["tokens"])]
        got = _failures(graph_findings(m, s))
        assert got == ([] if kind is None else [(kind, where, ranks)]), (s["inject"], got)
        seen += 1
    assert seen == len(expect)


@pytest.mark.parametrize("side", [False, True])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_static_slots_equal_the_torch_path(dt, side):
    """The static-buffer launches and their host combine against the independent torch path
    (same word hash, same bitmap, sketch within float tolerance), filled twice: the second fill
    (new values, same buffer) must not keep anything of the first."""
    import math

    from tpprobe.fingerprint.reference import _fingerprint_torch
    from tpprobe.capture.graph_tap import StaticFingerprints
    ts = [torch.randn(n, 7168, device="cuda").to(dt) for n in (1, 8, 64)] + \
        [torch.randn(8, 3 * 7168, device="cuda").to(dt)]
    slots = StaticFingerprints("cuda", seed=3, k=32, side_stream=side)
    for t in ts:
        slots.add(t)
    slots.freeze()
    for fill in range(2):
        for t in ts:
            t.normal_()
            t[t.shape[0] // 2] = 0
        slots.begin()
        for t in ts:
            slots.add(t)
        slots.end()
        for f, t in zip(slots.read(), ts):
            r = _fingerprint_torch(t, 3, 32)
            assert (f.bit_hash, f.row_nonzero, f.shape, f.dtype) == (r.bit_hash, r.row_nonzero, r.shape, r.dtype)
            assert f.sumsq == pytest.approx(r.sumsq, rel=1e-5) and f.absmax == r.absmax
            assert max(abs(a - b) for a, b in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq)
