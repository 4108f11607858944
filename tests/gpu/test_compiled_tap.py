"""Fingerprint taps inside PyTorch's own CUDA graphs (GPU only: `pytest -m gpu tests/gpu/test_compiled_tap.py`).

The built-in model under torch.compile: ``mode="reduce-overhead"`` (Inductor's kernels, recorded and
replayed by cudagraph trees) and ``backend="cudagraphs"`` (eager's aten kernels in cudagraph trees),
with `CompiledTaps` hooking every capture point through the ``tpprobe::fp_into`` op. Replayed with
NEW input ids, the fingerprints written inside the graph must equal, to the bit, those of the
same values taken after the replay (the EAGLE-3 slots the graph returns), and those of the same
forward run eagerly (cudagraphs backend; Inductor: within rounding noise); catalogue faults injected
before compiling must be named exactly (kind, place, ranks) from the replayed fingerprints. tp 1.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# (inject, tokens, backend, kind, where, ranks) at tp 1, as tests/gpu/test_graph_tap.py expects them
CASES = [
    (None, 1, "inductor", None, None, None),
    (None, 8, "inductor", None, None, None),
    (None, 8, "cudagraphs", None, None, None),
    ("nan@0", 8, "inductor", "non-finite", "layer.3.out", [0]),
    ("slot-order", 8, "inductor", "slot-mismatch", "aux slots [0, 1]", [0]),
    ("embed-after-norm", 8, "inductor", "transformed-capture", "aux slot 0", [0]),
]
_RESULTS: dict = {}


def _cfg():
    from tpprobe.engines.builtin.model import BuiltinConfig
    # 6 layers and ids [-1, 1, 3] as the catalogue tests; bf16 as served
    return BuiltinConfig(num_layers=6, hidden=1024, heads=8, ffn=2048, vocab=1000, dtype=torch.bfloat16)


def _result(case):
    key = tuple(case[:3])
    if key not in _RESULTS:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        import torch.distributed as dist
        from tpprobe.engines.builtin.graph import compiled_probe_rank
        from tpprobe.core.target import RankContext
        inject, tokens, backend = case[:3]
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), backend="gloo")
        _RESULTS[key] = compiled_probe_rank(ctx, _cfg(), [inject] if inject else [], tokens, backend=backend)
    return _RESULTS[key]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] is None], ids=lambda c: f"{c[2]}-{c[1]}tok")
def test_compiled_replay_fingerprints_equal(case):
    r = _result(case)
    # every point was tapped inside the graph: the embedding, layer 0's input norm, every layer's stream
    assert {"embed.out", "layer.0.in_norm", *(f"layer.{k}.out" for k in range(6))} <= set(r["points"])
    # the EAGLE-3 slots the graph returned, fingerprinted after the replay: equal to the bit
    assert sorted(r["aux"]) == ["embed.out", "layer.1.out", "layer.3.out"], r["aux"]
    assert all(a["equal"] for a in r["aux"].values()), r["aux"]
    # the same forward, eager: equal to the bit with eager's kernels, within rounding noise with Inductor's
    assert all(e["both"] and e["close"] for e in r["eager"].values()), r["eager"]
    if case[2] == "cudagraphs":
        assert all(e["hash_equal"] for e in r["eager"].values()), r["eager"]
    assert r["eager"]["embed.out"]["hash_equal"]           # a lookup: the same bits in any graph


@pytest.mark.parametrize("case", [c for c in CASES if c[0] is None], ids=lambda c: f"{c[2]}-{c[1]}tok")
def test_healthy_compiled_replay_has_no_findings(case):
    from tpprobe.engines.builtin.graph import graph_findings
    r = _result(case)
    findings = graph_findings({0: r["meta"]}, r["settings"])
    assert [f for f in findings if f["severity"] == "failure"] == [], findings


@pytest.mark.parametrize("case", [c for c in CASES if c[0] is not None], ids=lambda c: c[0])
def test_faults_in_the_compiled_model_are_named_exactly(case):
    from tpprobe.engines.builtin.graph import graph_findings
    r = _result(case)
    got = [(f["kind"], f["where"], f["ranks"]) for f in graph_findings({0: r["meta"]}, r["settings"])
           if f["severity"] == "failure"]
    assert got == [tuple(case[3:])], (case[0], got)
