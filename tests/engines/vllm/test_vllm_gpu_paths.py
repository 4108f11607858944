"""vLLM's GPU all-reduce paths through tpprobe's doors, on CPU (the vLLM tier).

One `tpprobe probe --model tests.zoo.vllm_gpu_paths:build` on 2 real gloo ranks: vLLM's own TP group, its
`CudaCommunicator` choosing the path with its own code, one layer per path (custom all-reduce, torch symmetric
memory, pynccl, torch.distributed, FlashInfer, the fused all-reduce + RMSNorm op, the custom op
`torch.ops.vllm.all_reduce` as a compiled graph calls it); what cannot run on a CPU (each communicator's CUDA
kernel) is substituted at its lowest point (tests/zoo/vllm_gpu_paths.py says what and why). Healthy: every reduce
READ and complete, zero findings, full coverage, each path named. Wrong sums (the live failure: a custom
all-reduce returning wrong data): each path's reduce named exactly, kind, layer and module, ranks.
"""
import re

import pytest

from tests.helpers.ranks import failures, run_cli
from tpprobe.engines.vllm import INSTALL_HINT, available

pytestmark = [pytest.mark.vllm]

ROUTES = ("custom", "symm_mem", "pynccl", "torch", "flashinfer", "fused", "op")
GC = "vllm.GroupCoordinator"
# the path each layer's reduce is recorded with: the door, the communicator vLLM picked, what ran below it
PATHS = {
    "custom": f"{GC}.all_reduce+CustomAllreduce.custom_all_reduce+c10d.allreduce_",
    "symm_mem": f"{GC}.all_reduce+SymmMemCommunicator.all_reduce+symm_mem.two_shot_all_reduce_+c10d.allreduce_",
    "pynccl": f"{GC}.all_reduce+PyNcclCommunicator.all_reduce+c10d.allreduce_",
    "torch": f"{GC}.all_reduce+c10d.allreduce_",
    # the first FlashInfer call makes vLLM's workspace (get_fi_ar_workspace: its node count is a collective over
    # the group) before the kernel runs: the path lists ops in the order first seen
    "flashinfer": f"{GC}.all_reduce+FlashInferAllReduce.all_reduce+c10d.allreduce_+flashinfer.comm.allreduce_fusion",
    # the fused op never reaches the coordinator: its door is FlashInfer's allreduce_fusion
    "fused": "flashinfer.comm.allreduce_fusion+c10d.allreduce_",
    # a compiled graph's custom op, without GroupCoordinator.all_reduce: the door it reaches
    "op": f"{GC}._all_reduce_out_place+CustomAllreduce.custom_all_reduce+c10d.allreduce_",
}


@pytest.fixture(autouse=True)
def _need_vllm(request):
    if available():
        return
    expr = request.config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bvllm\b", expr):
        pytest.fail(f"-m vllm asked for the vLLM tier but vllm is not importable here: run `{INSTALL_HINT}`")
    pytest.skip(f"vllm not installed: {INSTALL_HINT}")


def probe(out, factory, exchange):
    import json
    from pathlib import Path

    cp = run_cli(["probe", "--model", f"tests.zoo.vllm_gpu_paths:{factory}", "--nproc", "2", "--out", str(out),
                  "--exchange", exchange, "--quiet", "--timeout", "120"], timeout=300,
                 env={"OMP_NUM_THREADS": "1", "TPPROBE_VLLM_ALLREDUCE": "gloo", "VLLM_LOGGING_LEVEL": "ERROR"})
    rep = Path(out) / "report.json"
    assert rep.exists(), cp.stderr[-4000:]
    assert "Traceback" not in cp.stderr, cp.stderr[-3000:]
    return cp.returncode, json.loads(rep.read_text()), cp


def by_layer(rep) -> dict:
    return {e["layer"]: e for e in rep["allreduce"]["records"] if e.get("layer") is not None}


def test_every_gpu_path_is_read_and_complete(tmp_path):
    rc, rep, cp = probe(tmp_path, "build", "full")
    assert rc == 0, [f["line"] for f in rep["findings"]]
    assert rep["findings"] == []
    cov = rep["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == len(ROUTES)
    assert cov["unreadable_paths"] == {}
    # one reduce per layer and rank, each through the path its layer asked vLLM's dispatcher for, every one read
    assert cov["reduces_per_place"] == {f"layer.{k}": {"0": 1, "1": 1} for k in range(len(ROUTES))}
    assert cov["paths"] == {PATHS[p]: 1 for p in ROUTES}, cov["paths"]
    ar = rep["allreduce"]
    assert ar["unchecked"] == 0 and ar["incomplete"] == 0 and ar["checked"] == ar["complete"] == len(ROUTES)
    recs = by_layer(rep)
    assert [recs[k]["path"] for k in range(len(ROUTES))] == [PATHS[p] for p in ROUTES]
    assert all(recs[k]["level"] == "exact" or recs[k]["level"] == "noise" for k in recs), recs
    assert all(e["group"] == "tp:0" for e in ar["records"])


def test_a_wrong_sum_on_every_gpu_path_is_named(tmp_path):
    rc, rep, cp = probe(tmp_path, "build_wrong_sums", "fingerprint")
    assert rc == 1, cp.stderr[-3000:]
    # every substituted kernel returned the sum scaled by 2; vLLM's torch.distributed fallback (layer 3) is
    # torch's own call and stayed right: one finding per wrong reduce, at its layer and module, both ranks
    wrong = [k for k, p in enumerate(ROUTES) if p != "torch"]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [("allreduce-incomplete", f"layer {k} (layers.{k}.proj)", [0, 1]) for k in wrong], \
        [f["line"] for f in rep["findings"]]
    for f, k in zip(failures(rep), wrong):
        assert PATHS[ROUTES[k]] in f["detail"] and "the sum scaled by 2" in f["detail"], f["detail"]
        assert "group tp:0" in f["detail"], f["detail"]
    recs = by_layer(rep)
    assert recs[3]["level"] in ("exact", "noise") and recs[3]["path"] == PATHS["torch"]
    assert rep["allreduce"]["unchecked"] == 0 and rep["coverage"]["unreadable_paths"] == {}


def test_a_fused_reduce_that_cannot_be_read_is_counted_unchecked():
    """The fused door's other branch: a call whose reduced output is not in its arguments (here FlashInfer's
    entry called positionally; DeepSeek-V4.1's AllReduceMHC.finalize always) is one record, counted and not
    read (checked False: the coverage warning names its path), never a silent pass; a readable call beside
    it is read. In one process: the door's bookkeeping only, no collective runs."""
    import types

    import torch

    from tpprobe.capture.audit import Audit
    from tpprobe.engines.door import fused_door
    from tpprobe.engines.vllm.audit import fused_read

    audit = Audit(lambda t: ("layers.0.proj", 0, "layer.0", None))
    tap = types.SimpleNamespace(audit=True, auditor=audit, collective=audit.collective)
    group = types.SimpleNamespace(world_size=2, ranks=[0, 1], unique_name="tp:0")

    def allreduce_fusion(*args, **kw):         # what the kernel leaves: residual_out = sum + residual_in
        if kw:
            kw["residual_out"].add_(kw["input"] * 2)
        return None

    comm = types.SimpleNamespace(allreduce_fusion=allreduce_fusion,
                                 AllReduceFusionPattern=types.SimpleNamespace(kAllReduce=0, kARResidualRMSNorm=1))
    handles = fused_door(tap, comm, "allreduce_fusion", "flashinfer.comm.allreduce_fusion", fused_read(comm),
                         lambda kw: group)
    x, r = torch.ones(4, 8), torch.full((4, 8), 3.0)
    comm.allreduce_fusion(x, None, 1)
    comm.allreduce_fusion(input=x, workspace=None, pattern=1, residual_in=r, residual_out=r, norm_out=x.clone())
    for h in handles:
        h.remove()
    assert comm.allreduce_fusion is allreduce_fusion
    unread, read = audit.records
    assert (unread.path, unread.checked, unread.group, unread.shape) == ("flashinfer.comm.allreduce_fusion", False,
                                                                         "tp:0", (4, 8))
    assert unread.inp is None and unread.out is None
    # the readable call: its output is residual_out - residual_in (the residual copied on entry) = 2 x
    assert read.checked and torch.equal(read.inp, torch.ones(4, 8)) and torch.equal(read.out, torch.full((4, 8), 2.0))
