"""The spine end to end: `tpprobe probe` on real gloo ranks, healthy and with a broken all-reduce.

Each run starts real processes through PyTorch's elastic launcher, so these tests prove the whole
path: launch, hooks, store-first exchange, gather, checks, report.json, exit code.
"""
import json

import pytest
import torch

from tests.helpers.ranks import failures, probe, run_cli
from tpprobe.formats.capture_dir import load_run
from tpprobe.engines.builtin.model import BuiltinConfig, reference_streams

# bf16 keeps 8 mantissa bits: over 6 layers sharded and unsharded sums drift by ~1% (measured)
TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=0.15, rtol=0.03)}


@pytest.mark.parametrize("nproc,dtype,seed,layers", [
    (2, "float32", 0, "-1,1,3"),
    (2, "bfloat16", 1, "-1,2,4"),
    (4, "float32", 2, "-1,0,4"),
    (4, "bfloat16", 3, "1,3"),
])
def test_healthy_probe_has_zero_findings_and_captures_equal_the_reference(tmp_path, nproc, dtype, seed, layers):
    rc, rep, cp = probe(tmp_path / "run", "--dtype", dtype, "--seed", str(seed), "--layers", layers, nproc=nproc)
    assert rc == 0, cp.stderr[-2000:]
    assert rep["findings"] == []
    assert rep["settings"]["world_size"] == nproc and rep["allreduce"]["incomplete"] == 0
    assert rep["allreduce"]["checked"] == 2 * 6 + 1            # embedding + 2 per layer
    ref = reference_streams(BuiltinConfig(seed=seed, dtype=torch.float32))
    run = load_run(tmp_path / "run")
    ids = [int(x) for x in layers.split(",")]
    assert sorted(run.records) == list(range(nproc)) and not run.problems
    for rank, rec in run.records.items():
        packed = rec.tensors["aux.packed"]
        assert packed.shape == (16, 64 * len(ids)) and str(packed.dtype) == f"torch.{dtype}"
        for slot, i in zip(packed.split(64, -1), ids):
            want = ref["embed.out" if i == -1 else f"layer.{i}.out"]
            torch.testing.assert_close(slot.float(), want, **TOL[dtype], msg=f"id {i} rank {rank}")


def test_one_rank_is_not_checked_across_ranks_and_still_names_a_slot_fault(tmp_path):
    """tp 1 (a one-GPU NCCL run, or a first check): no peer to agree with, no all-reduce; the verdict
    says so, never HEALTHY, live and from the folder (exit 0: what could be checked passed), over full
    coverage; a single-rank fault is still named."""
    rc, rep, cp = probe(tmp_path / "h", nproc=1)
    assert rc == 0 and rep["findings"] == [], cp.stderr[-2000:]
    assert rep["settings"]["world_size"] == 1 and rep["allreduce"]["checked"] == 0
    cov = rep["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == 6 and cov["embed"] == "embed_tokens" and cov["audit"], cov
    assert [x["ok"] for x in rep["slots"]] == [True] * 3
    line = ("NOT CHECKED ACROSS RANKS (1 rank: no other rank to compare with, no all-reduce to check): the 3 aux "
            "slots hold the points they should and no value is NaN or Inf")
    assert line in " ".join(cp.stdout.split()) and "HEALTHY" not in cp.stdout, cp.stdout
    md = tmp_path / "r.md"
    cp = run_cli(["report", str(tmp_path / "h"), "--markdown", str(md)])
    assert cp.returncode == 0 and line in " ".join(cp.stdout.split()) and "HEALTHY" not in cp.stdout, cp.stdout
    assert f"- 🔵 `{line}`" in md.read_text() and "HEALTHY" not in md.read_text()
    rc, rep, cp = probe(tmp_path / "f", "--inject", "slot-order", nproc=1)
    assert rc == 1 and [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)] == \
        [("slot-mismatch", "aux slots [0, 1]", [0])], rep["findings"]
    assert "HEALTHY" not in cp.stdout


def test_skipped_embedding_allreduce_is_reported_as_partial(tmp_path):
    rc, rep, _ = probe(tmp_path / "r", "--inject", "skip-embed-allreduce")
    assert rc == 1
    [f] = failures(rep)
    assert f["kind"] == "partial-allreduce" and f["where"].startswith("embedding") and f["ranks"] == [0, 1]
    assert f["evidence"]["rows_nonzero_on_one_rank"] == 1.0
    assert f["evidence"]["sum_over_ranks_vs_reference"] in ("bitwise", "noise")


def test_skipped_o_proj_allreduce_in_one_layer_is_named_at_that_layer(tmp_path):
    rc, rep, _ = probe(tmp_path / "r", "--inject", "skip-allreduce@2")
    assert rc == 1
    [f] = failures(rep)
    assert (f["kind"], f["where"], f["ranks"]) == ("partial-allreduce", "layer 2 (layers.2.self_attn.o_proj)", [0, 1])
    assert f["consequences"], "later layers diverge too, grouped under the root"


def test_report_rerenders_offline_with_the_same_findings(tmp_path):
    rc, rep, _ = probe(tmp_path / "r", "--inject", "skip-allreduce@1")
    cp = run_cli(["report", str(tmp_path / "r"), "--json"])
    assert cp.returncode == rc == 1
    offline = json.loads(cp.stdout)
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures(offline)] == \
           [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
