"""The verdict listens to the audit (catalogue rows F22-F25): start at `CASES`.

Each case runs `tpprobe probe` (real gloo ranks, real torch.distributed) with one fault of the
catalogue and asserts the exact diagnosis (kind, place, ranks) in both exchange modes:

  F22  a reduce that runs and returns the wrong value on every rank (a scaled sum, one rank's
       buffer handed to all, the previous call's output / a fresh buffer of zeros): the ranks agree,
       only the audit's input/output pair shows it; named `allreduce-incomplete` at the reduce,
       with what the output is instead
  F23  the same on one rank (the sum never happened there): `allreduce-incomplete` on that rank,
       never "a stale weight shard"
  F24  the row-parallel reduce missing where no other layer can vouch for it (every layer, layer 0
       of 2, the last layer, a 1-layer model) at tp 2 and 4: `partial-allreduce` at the module
  F25  a reduce the audit counts but cannot read goes missing: named at its module and layer with
       its path, never `subgroup-allreduce`

The same verdict for a reduce-scatter (not its slice of the sum) and an all-gather (a block not
what its rank sent) on tests/zoo/sp_comm.py, and for MAX / MIN / PRODUCT (tests/zoo/amax.py) and an
all-to-all (tests/zoo/a2a.py), each by its own definition. Each wrong rank's error (relative to
what a complete collective returns) is asserted where the injection implies it; in fingerprint mode
no tensor moves beyond the diverging stream points' detail (none where the ranks agree).

Every report made here also goes through `assert_verdict_agrees_with_audit`, which renders the
report as the terminal prints it and parses its audit line and its verdict lines: HEALTHY never
appears beside an incomplete reduce, and each incomplete reduce has its finding.
"""
from __future__ import annotations

import io
import re

import pytest

import json
from pathlib import Path

from tests.helpers.ranks import failures, run_cli
from tpprobe.engines.sglang import INSTALL_HINT, available


def render(rep: dict) -> str:
    from rich.console import Console

    from tpprobe.probe.report import render as term
    con = Console(file=io.StringIO(), width=400, record=True, color_system=None)
    term(rep, con)
    return con.export_text()


def assert_verdict_agrees_with_audit(rep: dict) -> None:
    """The report's audit line and its verdict never contradict each other."""
    text = render(rep)
    audit = next((ln for ln in text.splitlines() if ln.startswith("all-reduce audit:")), None)
    verdict = text[text.index("\nverdict\n"):] if "\nverdict\n" in text else ""
    assert verdict, text[-2000:]
    if audit is not None:
        n = int(re.search(r"(\d+) incomplete", audit).group(1))
        assert n == rep["allreduce"]["incomplete"], (audit, rep["allreduce"])
        if n:
            assert "HEALTHY" not in verdict and "every all-reduce is complete" not in verdict, text[-3000:]
            named = {f["evidence"]["seq"] for f in rep["findings"] if f["kind"] == "allreduce-incomplete"}
            bad = {e["seq"] for e in rep["allreduce"]["records"] if e["level"] == "incomplete"}
            assert bad and bad <= named | set(sorted(bad)[8:]), (bad, named)
    for f in rep["findings"]:
        if f["kind"] == "allreduce-incomplete":
            e = rep["allreduce"]["records"][f["evidence"]["seq"]]
            assert e["level"] == "incomplete", (f["line"], e)
    if "HEALTHY" in verdict:
        assert not rep["findings"] and rep["allreduce"].get("incomplete", 0) == 0
    if audit is not None and re.search(r"[1-9]\d* unchecked", audit):   # counted unchecked: said, never HEALTHY
        assert "HEALTHY" not in verdict, text[-3000:]
        assert any(f["kind"] == "coverage" and f["where"] == "collective audit" for f in rep["findings"]), audit
    # "stale or wrong weight shard" only where a parameter points there
    for f in rep["findings"]:
        if "weight shard" in (f.get("explain") or ""):
            assert "parameter" in f["where"], f


def tensor_bytes_moved(rep: dict, out) -> tuple[int, int]:
    """(tensor bytes the reference rank sent in a fingerprint exchange, what the exchange's detail
    path allows it): the only tensors that path moves are the reference rank's copies of kept
    stream points whose ranks differ, to each other rank; never a collective's input or output,
    so an audit verdict there came from the sketches alone. Where every rank agrees it is 0."""
    from safetensors import safe_open
    with safe_open(str(Path(out) / "rank-000.safetensors"), "pt") as f:
        kept = {k: f.get_slice(k) for k in f.keys()}
    differ = {p["name"] for p in rep["points"]
              if any(s["level"] not in ("reference", "bitwise", "share") for s in p["per_rank"].values())}
    world = rep["settings"]["world_size"]
    allowed = 0
    for name in differ & set(kept):
        sl = kept[name]
        n = 1
        for d in sl.get_shape():
            n *= d
        allowed += n * {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}[sl.get_dtype()] * (world - 1)
    return rep["exchange"]["bytes_per_rank"]["0"]["tensor_sent"], allowed


def implied_one_rank_error(out, seq: int, rank: int, nproc: int, exchange: str) -> float:
    """||x_R - S|| / ||S||: the error of an all-reduce that returns rank R's input x_R instead of the
    sum S, computed here from the inputs alone (never the output): in full mode from the captured
    tensors, exactly; in fingerprint mode from the inputs' posted sketches (linear: S's sketch is
    their sum), the estimate the probe can make without moving a tensor."""
    import math
    if exchange == "full":
        from safetensors.torch import load_file
        ins = [load_file(str(Path(out) / f"rank-{q:03d}.safetensors"))[f"allreduce.{seq}.in"].double()
               for q in range(nproc)]
        s = sum(ins)
        return float((ins[rank] - s).norm() / s.norm())
    sk = [json.loads((Path(out) / f"rank-{q:03d}.json").read_text())["allreduces"][seq]["in_fp"]["sketch"]
          for q in range(nproc)]
    s = [math.fsum(col) for col in zip(*sk)]
    return math.dist(sk[rank], s) / math.hypot(*s)


def probe(out, *args, nproc=2, timeout=180, env=None):
    """`tpprobe probe --nproc N --out OUT --quiet ARGS` in a fresh process (env: extra variables)."""
    cp = run_cli(["probe", "--nproc", str(nproc), "--out", str(out), "--quiet", *args], timeout=timeout, env=env)
    path = Path(out) / "report.json"
    rep = json.loads(path.read_text()) if path.exists() else {}
    rc = cp.returncode
    assert rep, cp.stderr[-3000:]
    assert_verdict_agrees_with_audit(rep)
    return rc, rep, cp


O = "layers.{}.self_attn.o_proj"
# (inject, nproc, extra args, kind, where, ranks, what the detail must say)
CASES = [
    ("allreduce-scaled@2", 2, [], "allreduce-incomplete", f"layer 2 ({O.format(2)})", [0, 1], "the sum scaled by 2"),
    ("allreduce-scaled@0", 4, [], "allreduce-incomplete", f"layer 0 ({O.format(0)})", [0, 1, 2, 3],
     "the sum scaled by 2"),
    ("allreduce-one-buffer@1", 4, [], "allreduce-incomplete", f"layer 1 ({O.format(1)})", [0, 1, 2, 3],
     "rank 0's input alone"),
    ("allreduce-stale@3", 2, [], "allreduce-incomplete", f"layer 3 ({O.format(3)})", [0, 1],
     "the previous all-reduce's output"),
    ("allreduce-stale@0", 2, [], "allreduce-incomplete", f"layer 0 ({O.format(0)})", [0, 1], "returned zeros"),
    ("allreduce-rank@1", 2, [], "allreduce-incomplete", f"layer 3 ({O.format(3)})", [1], "rank 1's input alone"),
    ("allreduce-rank@2", 4, [], "allreduce-incomplete", f"layer 3 ({O.format(3)})", [2], "rank 2's input alone"),
    ("skip-allreduce-all", 2, [], "partial-allreduce", f"layer 0 ({O.format(0)})", [0, 1], "in every layer (6 of 6)"),
    ("skip-allreduce-all", 4, [], "partial-allreduce", f"layer 0 ({O.format(0)})", [0, 1, 2, 3], "in every layer"),
    ("skip-allreduce@0", 2, ["--num-layers", "1", "--layers", "-1"], "partial-allreduce", f"layer 0 ({O.format(0)})",
     [0, 1], "never all-reduced"),
    ("skip-allreduce@0", 4, ["--num-layers", "1", "--layers", "-1"], "partial-allreduce", f"layer 0 ({O.format(0)})",
     [0, 1, 2, 3], "never all-reduced"),
    ("skip-allreduce@0", 2, ["--num-layers", "2", "--layers", "-1,0"], "partial-allreduce", f"layer 0 ({O.format(0)})",
     [0, 1], "never all-reduced"),
    ("skip-allreduce@1", 4, ["--num-layers", "2", "--layers", "-1,0"], "partial-allreduce", f"layer 1 ({O.format(1)})",
     [0, 1, 2, 3], "never all-reduced"),
    ("skip-allreduce@5", 2, [], "partial-allreduce", f"layer 5 ({O.format(5)})", [0, 1],
     "1 all-reduce(s) ran in layer 5 (other layers: 2)"),
    ("skip-unreadable-allreduce@2", 2, [], "partial-allreduce", f"layer 2 ({O.format(2)})", [0, 1],
     "tpprobe_fault.shm_allreduce"),
    ("skip-unreadable-allreduce@1", 4, [], "partial-allreduce", f"layer 1 ({O.format(1)})", [0, 1, 2, 3],
     "tpprobe_fault.shm_allreduce"),
]


# every case in both exchange modes; CI's 2 cores run each case in one mode (the modes alternate down
# the list), the sweep tier (`-m sweep`, run before a change is called done) the other
MODE_PARAMS = [pytest.param(*c, mode, id=f"{c[0]}-tp{c[1]}{'-L' + c[2][1] if c[2] else ''}-{mode}",
                            marks=() if (i + (mode == "fingerprint")) % 2 == 0 else pytest.mark.sweep)
               for i, c in enumerate(CASES) for mode in ("full", "fingerprint")]


@pytest.mark.parametrize("inject,nproc,extra,kind,where,ranks,says,exchange", MODE_PARAMS)
def test_a_wrong_or_missing_reduce_is_named_exactly(tmp_path, inject, nproc, extra, kind, where, ranks, says, exchange):
    rc, rep, cp = probe(tmp_path / "r", "--inject", inject, "--exchange", exchange, *extra, nproc=nproc)
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [(kind, where, ranks)], [f["line"] for f in rep["findings"]]
    f = failures(rep)[0]
    assert says in f["detail"], f["line"]
    assert "weight shard" not in f["explain"] and f["explain"]
    if kind == "partial-allreduce" and not inject.startswith("skip-unreadable"):
        # the data's own signature beside the structure's or the count's evidence
        sig = f["evidence"]["partial_sum_signature"]
        assert sig["max_cosine"] < 0.95 and sig["ranks"] == list(range(nproc)), f["evidence"]
        # the o_proj reduce is followed by the MLP's in each layer, so the increments do not sum to the tp=1
        # reference (they do only where the missing reduce is the layer's last sum): never claimed here
        assert sig["sum_vs_reference"] == "material" and "tp=1 reference" not in f["detail"] + f["explain"]
    if kind == "allreduce-incomplete":
        e = rep["allreduce"]["records"][f["evidence"]["seq"]]
        assert e["level"] == "incomplete" and e["where"] == f"layer.{where.split()[1]}"
        assert rep["allreduce"]["method"] == ("sketch" if exchange == "fingerprint" else "tensors")
        assert f"all-reduce #{e['seq']} (tpprobe.engines.builtin.faults.Communicator.all_reduce" in f["detail"]
        # each wrong rank's error, relative to the sum, is what the injection implies: a sum x 2 is off
        # by exactly 1 (in fingerprint mode too: the sketch of a scaled sum is the scaled sketch); one
        # rank's input x_R for the sum S by ||x_R - S|| / ||S|| (in fingerprint mode, the sketches' estimate of it)
        per = f["evidence"]["per_rank"]
        assert sorted(int(r) for r, p in per.items() if p["level"] == "material") == ranks, per
        if inject.startswith("allreduce-scaled"):
            assert all(abs(per[str(r)]["error"] - 1.0) < 1e-4 for r in ranks), per
            assert ", ".join(f"rank {r} 1" for r in ranks) + ")" in f["detail"], f["detail"]
        if inject.startswith(("allreduce-rank", "allreduce-one-buffer")):
            src = ranks[0] if inject.startswith("allreduce-rank") else 0
            want = implied_one_rank_error(tmp_path / "r", e["seq"], src, nproc, exchange)
            tol = 1e-6
            for r in ranks:
                assert abs(per[str(r)]["error"] - want) <= tol * want, (r, per[str(r)]["error"], want)
        if exchange == "fingerprint":   # "no full tensor moved": the verdict came from the sketches alone
            sent, allowed = tensor_bytes_moved(rep, tmp_path / "r")
            assert sent == allowed, (sent, allowed)
            if len(ranks) == nproc:     # the ranks agree: not one tensor byte
                assert all(b["tensor_sent"] == b["tensor_received"] == 0
                           for b in rep["exchange"]["bytes_per_rank"].values()), rep["exchange"]
    if inject.startswith("skip-unreadable"):
        assert not any(x["kind"] == "subgroup-allreduce" for x in rep["findings"])
        assert any(x["kind"] == "coverage" and x["severity"] == "warning" for x in rep["findings"])


@pytest.mark.parametrize("exchange", ["full", "fingerprint"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_healthy_run_through_the_models_own_communicator_has_no_finding(tmp_path, exchange, nproc):
    # the communicator of the F22 faults with nothing corrupted: scale 1 is the plain sum
    rc, rep, cp = probe(tmp_path / "r", "--inject", "allreduce-scaled@2", "--exchange", exchange, nproc=nproc,
                        env={"TPPROBE_INJECT_SCALE": "1"})
    assert rc == 0, [f["line"] for f in rep["findings"]]
    assert rep["findings"] == []
    assert rep["allreduce"]["incomplete"] == 0 and rep["allreduce"]["checked"] == len(rep["allreduce"]["records"])
    cov = rep["coverage"]
    assert cov["layers_found"] == 6 and cov["embed"] and not cov["unreadable_paths"]


# bfloat16's pair in CI; float32's and float16's in the sweep (the same rule, the bounds of their dtypes)
@pytest.mark.parametrize("dtype,scale,found", [
    pytest.param("float32", "1.0002", True, marks=pytest.mark.sweep),
    pytest.param("float32", "1.00002", False, marks=pytest.mark.sweep),
    ("bfloat16", "1.06", True), ("bfloat16", "1.03", False),
    pytest.param("float16", "1.008", True, marks=pytest.mark.sweep),
    pytest.param("float16", "1.004", False, marks=pytest.mark.sweep),
])
def test_the_smallest_scale_error_a_reduce_audit_finds_per_dtype(tmp_path, dtype, scale, found):
    """docs/noise.md's row for a wrong reduce: a scale error above the reduce bound is always found,
    one far below it (rounding-sized) never."""
    rc, rep, _ = probe(tmp_path / "r", "--inject", "allreduce-scaled@2", "--dtype", dtype, nproc=2,
                       env={"TPPROBE_INJECT_SCALE": scale})
    kinds = [f["kind"] for f in failures(rep)]
    assert kinds == (["allreduce-incomplete"] if found else []), [f["line"] for f in rep["findings"]]
    assert rc == (1 if found else 0)


# ---- SGLang's own models: the same faults through GroupCoordinator.all_reduce ----------------------
SG = "model.layers.{}.self_attn.o_proj"
SG_CASES = [
    ("llama", "allreduce-scaled@2", 2, "full", "allreduce-incomplete", f"layer 2 ({SG.format(2)})", [0, 1],
     "the sum scaled by 2"),
    ("llama", "allreduce-scaled@2", 2, "fingerprint", "allreduce-incomplete", f"layer 2 ({SG.format(2)})", [0, 1],
     "the sum scaled by 2"),
    ("qwen3", "allreduce-one-buffer@1", 4, "fingerprint", "allreduce-incomplete", f"layer 1 ({SG.format(1)})",
     [0, 1, 2, 3], "rank 0's input alone"),
    ("llama", "allreduce-stale@2", 2, "full", "allreduce-incomplete", f"layer 2 ({SG.format(2)})", [0, 1],
     "the previous all-reduce's output"),
    ("llama", "allreduce-rank@1", 2, "full", "allreduce-incomplete", f"layer 2 ({SG.format(2)})", [1],
     "rank 1's input alone"),
    ("llama", "skip-allreduce-all", 2, "full", "partial-allreduce", f"layer 0 ({SG.format(0)})", [0, 1],
     "in every layer (4 of 4)"),
    ("llama", "skip-allreduce-all", 4, "fingerprint", "partial-allreduce", f"layer 0 ({SG.format(0)})", [0, 1, 2, 3],
     "in every layer (4 of 4)"),
    ("llama", "skip-unreadable-allreduce@2", 2, "fingerprint", "partial-allreduce", f"layer 2 ({SG.format(2)})",
     [0, 1], "tpprobe_fault.shm_allreduce"),
    # MLA + MoE: layer 0 dense, layers 1-3 MoE (their reduce counts differ from the dense layer's)
    ("deepseek_v2", "skip-allreduce-all", 2, "full", "partial-allreduce", f"layer 0 ({SG.format(0)})", [0, 1],
     "in every layer (4 of 4)"),
    ("deepseek_v2", "allreduce-scaled@1", 2, "fingerprint", "allreduce-incomplete", f"layer 1 ({SG.format(1)})",
     [0, 1], "the sum scaled by 2"),
    ("deepseek_v2", "skip-unreadable-allreduce@0", 2, "fingerprint", "partial-allreduce", f"layer 0 ({SG.format(0)})",
     [0, 1], "tpprobe_fault.shm_allreduce"),
    # one layer's o_proj reduce: the dense layer 0 (no other layer of its kind) and an MoE layer
    ("deepseek_v2", "skip-allreduce@0", 2, "full", "partial-allreduce", f"layer 0 ({SG.format(0)})", [0, 1],
     "(no other layer of its kind)"),
    ("deepseek_v2", "skip-allreduce@2", 4, "fingerprint", "partial-allreduce", f"layer 2 ({SG.format(2)})",
     [0, 1, 2, 3], "(other layers of its kind: 2)"),
]


# CI's 2 cores run llama at tp 2 (every fault kind, both modes); the tp-4, qwen3 and deepseek_v2 cases
# run in the sweep tier (`-m sweep`), which is run before a change is called done
# the same kinds run in CI (partial-allreduce: skip-unreadable-allreduce@2, in fingerprint mode)
SWEEP_ONLY = {("allreduce-scaled@2", "fingerprint"), ("allreduce-stale@2", "full"), ("skip-allreduce-all", "full")}
SG_PARAMS = [pytest.param(*c, id=f"{c[0]}-{c[1]}-tp{c[2]}-{c[3]}",
                          marks=() if c[0] == "llama" and c[2] == 2 and c[1:4:2] not in SWEEP_ONLY
                          else pytest.mark.sweep)
             for c in SG_CASES]


@pytest.mark.sglang
@pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")
@pytest.mark.parametrize("arch,inject,nproc,exchange,kind,where,ranks,says", SG_PARAMS)
def test_sglang_reduce_faults_are_named_exactly(tmp_path, arch, inject, nproc, exchange, kind, where, ranks, says):
    rc, rep, cp = probe(tmp_path / "r", "--engine", "sglang", "--arch", arch, "--num-layers", "4", "--inject", inject,
                        "--exchange", exchange, nproc=nproc, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [(kind, where, ranks)], [f["line"] for f in rep["findings"]]
    f = failures(rep)[0]
    assert says in f["detail"], f["line"]
    if kind == "allreduce-incomplete":
        assert "sglang.GroupCoordinator.all_reduce" in f["detail"] and "group tp:0" in f["detail"]


# ---- row-parallel modules recognised from structure (capture/rowparallel.py) ------------------------
def test_row_parallel_modules_are_recognised_from_their_attributes_and_shape_not_their_name():
    import torch

    from tpprobe.capture import discover
    from tpprobe.capture.rowparallel import is_row_parallel

    class OutProj(torch.nn.Module):            # vLLM / Megatron style, named like nothing we know
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, 32))
            self.input_is_parallel = True

    class Dense(torch.nn.Module):              # SGLang style: a reduce flag on a linear shard
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(64, 64))
            self.reduce_results = False

    class Column(torch.nn.Module):             # column-parallel: no input shard, no reduce flag
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(96, 64))
            self.gather_output = False

    class Experts(torch.nn.Module):            # FusedMoE: a reduce flag, but no 2-D weight
        def __init__(self):
            super().__init__()
            self.w2_weight = torch.nn.Parameter(torch.zeros(4, 64, 32))
            self.reduce_results = True

    assert is_row_parallel(OutProj()) and discover.is_row_parallel(OutProj())
    assert is_row_parallel(Dense()) and discover.is_row_parallel(Dense())
    assert not is_row_parallel(Column()) and not discover.is_row_parallel(Column())
    assert not is_row_parallel(Experts())
    shard = torch.nn.Linear(32, 64, bias=False)          # weight [hidden, hidden / tp] at tp 2
    assert not is_row_parallel(shard, hidden=64, world=2)
    assert is_row_parallel(shard, hidden=64, world=2, shape=True)
    assert not is_row_parallel(torch.nn.Linear(64, 64), hidden=64, world=2, shape=True)


# ---- every op by its own definition ----------------------------------------------------------------
def test_max_min_and_product_reduces_are_checked_by_their_definition(tmp_path):
    rc, rep, cp = probe(tmp_path / "r", "--model", "tests.zoo.amax:build", "--layers", "-1,1", nproc=2)
    ops = [e["op"] for e in rep["allreduce"]["records"]]
    assert {"MAX", "MIN", "PRODUCT", "SUM"} <= set(ops), ops
    assert all(e["level"] in ("exact", "noise") for e in rep["allreduce"]["records"] if e["op"] != "CAT"), \
        [(e["op"], e["level"]) for e in rep["allreduce"]["records"]]
    assert rep["allreduce"]["unchecked"] == 0 and rc == 0 and rep["findings"] == [], [f["line"]
                                                                                      for f in rep["findings"]]


def test_a_wrong_max_min_or_product_is_named_at_its_reduce_in_full_mode(tmp_path):
    """tests/zoo/amax.py's `wrong`: layer 0's MAX on rank 1 returns rank 1's own amax, layer 1's MIN
    rank 0's value on every rank, layer 2's PRODUCT the product x 2: each named, by its op."""
    rc, rep, cp = probe(tmp_path / "r", "--model", "tests.zoo.amax:wrong", "--layers", "-1,1", nproc=2)
    assert rc == 1, cp.stderr[-3000:]
    D = "layer {} (layers.{}.mlp.down_proj)"
    got = [(f["kind"], f["where"], f["ranks"], f["evidence"]["op"]) for f in failures(rep)]
    assert got == [("allreduce-incomplete", D.format(0, 0), [1], "MAX"),
                   ("allreduce-incomplete", D.format(1, 1), [0, 1], "MIN"),
                   ("allreduce-incomplete", D.format(2, 2), [0, 1], "PRODUCT")], [f["line"] for f in rep["findings"]]
    mx, mn, pr = failures(rep)
    assert "not the MAX reduction of its inputs: on rank 1 it returned rank 1's input alone" in mx["detail"]
    assert "not the MIN reduction of its inputs: on ranks [0, 1] it returned rank 0's input alone" in mn["detail"]
    assert "not the PRODUCT reduction of its inputs: on ranks [0, 1] it returned the PRODUCT reduction scaled by 2" \
        in pr["detail"]
    assert "tests.zoo.amax.Sync.all_reduce+c10d.allreduce_" in mx["detail"]
    assert rep["allreduce"]["incomplete"] == 3 and rep["allreduce"]["unchecked"] == 0
    line = next(ln for ln in render(rep).splitlines() if ln.startswith("all-reduce audit:"))
    assert "(the MAX, MIN, PRODUCT ones by their own definition)" in line and "3 incomplete" in line


def test_an_op_sketches_cannot_check_is_counted_unchecked_and_said(tmp_path):
    """The same broken MAX / MIN / PRODUCT in fingerprint mode: sketches cannot check them, so they are
    counted unchecked in coverage and on the audit line, never passed silently (and never HEALTHY)."""
    rc, rep, cp = probe(tmp_path / "r", "--model", "tests.zoo.amax:wrong", "--layers", "-1,1", "--exchange",
                        "fingerprint", nproc=2)
    why = rep["allreduce"]["unchecked_why"]
    assert why == {"op MAX not checkable from sketches": 4, "op MIN not checkable from sketches": 4,
                   "op PRODUCT not checkable from sketches": 4}, why
    [w] = [f for f in rep["findings"] if f["kind"] == "coverage"]
    assert w["severity"] == "warning" and "4 × op MAX not checkable from sketches" in w["detail"]
    assert rc == 0 and not failures(rep)
    text = render(rep)
    line = next(ln for ln in text.splitlines() if ln.startswith("all-reduce audit:"))
    assert ("0 incomplete, 12 unchecked (4 × op MAX not checkable from sketches (fingerprint mode), "
            "4 × op MIN not checkable from sketches (fingerprint mode), 4 × op PRODUCT") in line, line
    assert "HEALTHY" not in text


def test_a_reduce_left_unchecked_for_a_reason_other_than_its_op_is_said_too(tmp_path):
    """A NaN in fingerprint mode leaves the reduces it reaches unchecked (a sketch cannot sum it): the
    audit line's count and a coverage warning with what to do say so, beside the non-finite root (before,
    only an op's reason was said and any other reason could stand under HEALTHY)."""
    rc, rep, cp = probe(tmp_path / "r", "--inject", "nan@0", "--exchange", "fingerprint", nproc=2)
    assert rc == 1, cp.stderr[-2000:]
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)] == [("non-finite", "layer.3.out", [0])]
    n = rep["allreduce"]["unchecked_why"]["non-finite values (a sketch cannot sum them)"]
    [w] = [f for f in rep["findings"] if f["kind"] == "coverage" and f["where"] == "collective audit"]
    assert w["severity"] == "warning" and f"{n} × non-finite values" in w["detail"], w["detail"]
    assert "--exchange full judges its finite elements" in w["detail"]
    assert_verdict_agrees_with_audit(rep)


def test_avg_is_checked_by_its_definition_on_real_tensors():
    """Gloo has no AVG (NCCL's ReduceOp.AVG), so no gloo run can issue one: the check itself, on real
    tensors, in both exchange modes: the mean is complete, the sum handed back for a mean is not."""
    import torch

    from tpprobe.formats.capture_dir import LoadedRank
    from tpprobe.capture.points import allreduce_in, allreduce_out
    from tpprobe.checks.allreduce import allreduce_audit
    from tpprobe.checks.evidence import FingerprintEvidence, TensorEvidence
    from tpprobe.fingerprint.reference import fingerprint

    g = torch.Generator().manual_seed(3)
    ins = [torch.randn(8, 16, generator=g) for _ in range(4)]
    mean, total = sum(ins) / 4, sum(ins)

    def records(out):
        meta = {"seq": 0, "where": "layer.0", "module": "m", "source": None, "layer": 0, "shape": [8, 16],
                "dtype": "float32", "group_size": 4, "op": "AVG", "kind": "all_reduce", "path": "c10d.allreduce_"}
        rank = {"world_size": 4, "status": "ok", "error": None, "points": [], "unreduced_rows": [],
                "embed_module": None, "layers_hooked": 1, "aux": {}, "params": {}, "timings": {}, "device": "cpu"}
        return {r: LoadedRank(r, {**rank, "rank": r, "allreduces": [dict(meta, in_fp=fingerprint(ins[r]).to_json(),
                                                                         out_fp=fingerprint(out).to_json())]},
                              {allreduce_in(0): ins[r], allreduce_out(0): out.clone()}) for r in range(4)}

    for ev in (lambda rec: TensorEvidence(rec, torch.float32), lambda rec: FingerprintEvidence(rec, torch.float32, {})):
        ok = allreduce_audit(ev(records(mean)), records(mean), [0, 1, 2, 3], 4)
        assert (ok["complete"], ok["incomplete"], ok["unchecked"]) == (1, 0, 0), ok
        bad = allreduce_audit(ev(records(total)), records(total), [0, 1, 2, 3], 4)
        assert (bad["complete"], bad["incomplete"]) == (0, 1), bad
        assert {p["level"] for p in bad["records"][0]["per_rank"].values()} == {"material"}


# ---- all-to-all by its own definition (tests/zoo/a2a.py) -------------------------------------------
A2A = [pytest.param("healthy", mode, id=f"healthy-{mode}", marks=() if mode == "full" else pytest.mark.sweep)
       for mode in ("full", "fingerprint")] + \
      [pytest.param("wrong", mode, id=f"wrong-{mode}", marks=() if mode == "fingerprint" else pytest.mark.sweep)
       for mode in ("full", "fingerprint")]


@pytest.mark.parametrize("factory,exchange", A2A)
def test_an_all_to_all_is_checked_chunk_by_chunk(tmp_path, factory, exchange):
    rc, rep, cp = probe(tmp_path / "r", "--model", f"tests.zoo.a2a:{factory}", "--exchange", exchange, nproc=2)
    a2a = [e for e in rep["allreduce"]["records"] if e["kind"] == "all_to_all"]
    assert len(a2a) == 3 and all(e["op"] == "PERMUTE" for e in a2a), rep["allreduce"]["records"]
    assert rep["allreduce"]["checked"] == 6 and rep["allreduce"]["unchecked"] == 0
    if factory == "healthy":
        assert rc == 0 and rep["findings"] == [], [f["line"] for f in rep["findings"]]
        assert all(e["level"] == "exact" for e in rep["allreduce"]["records"] if e["kind"] == "all_to_all")
        assert rep["coverage"]["layers_found"] == 3 and rep["coverage"]["embed"]
        assert {w: v for w, v in rep["coverage"]["reduces_per_place"].items()} == \
            {f"layer.{k}": {"0": 1, "1": 1} for k in range(3)}      # an all-to-all is not a reduce
        return
    assert rc == 1, cp.stderr[-3000:]
    [f] = failures(rep)
    assert (f["kind"], f["where"], f["ranks"]) == ("allreduce-incomplete", "layer 1 (layers.1)", [1]), f["line"]
    assert f["detail"].startswith("all-to-all #2 (tests.zoo.a2a.Comm.all_to_all+c10d.alltoall_base_, 2 ranks")
    assert "on rank 1 it returned wrong chunks from rank 0 (not what that rank sent it)" in f["detail"], f["line"]


# ---- a reduce-scatter and an all-gather by their own definition (tests/zoo/sp_comm.py) ---------------------
# a sequence-parallel model whose reduce-scatter / all-gather go through a communicator above c10d
# (`tap.collective`, as the F22 faults do), broken as a custom kernel breaks; layer k issues
# reduce-scatter #(2k+1) and all-gather #(2k+2) (#0: the embedding's all-reduce)
RS, AG = "reduce-scatter", "all-gather"
SP = [  # (SP_FAULT, nproc, collective, layer, ranks, what the detail says, each wrong rank's error or None)
    ("rs-scaled@2", 2, RS, 2, [0, 1], "on ranks [0, 1] it returned its slice of the sum scaled by 2", 1.0),
    ("rs-scaled@1", 4, RS, 1, [0, 1, 2, 3], "on ranks [0, 1, 2, 3] it returned its slice of the sum scaled by 2", 1.0),
    ("rs-own@1:1", 2, RS, 1, [1],
     "on rank 1 it returned rank 1's own slice of its input alone (the sum never happened)", None),
    ("rs-own@3:2", 4, RS, 3, [2], "on rank 2 it returned rank 2's own slice of its input alone", None),
    ("rs-other@0", 4, RS, 0, [0, 1, 2, 3], "on rank 0 it returned rank 1's slice of the sum (not its own); on rank 1 "
     "it returned rank 2's slice of the sum (not its own); on rank 2 it returned rank 3's slice", None),
    ("ag-stale@2", 2, AG, 2, [0, 1], "on ranks [0, 1] it returned a stale block in rank 1's place (the previous "
     "all-gather's: that write never landed)", None),
    ("ag-stale@0", 4, AG, 0, [0, 1, 2, 3], "on ranks [0, 1, 2, 3] it returned zeros in rank 1's block", None),
    ("ag-stale@3:0", 2, AG, 3, [0], "on rank 0 it returned a stale block in rank 1's place", None),
    ("ag-swap@1", 2, AG, 1, [0, 1], "on ranks [0, 1] it returned rank 1's block in rank 0's place and rank 0's block "
     "in rank 1's place", None),
    ("ag-swap@2:3", 4, AG, 2, [3], "on rank 3 it returned rank 1's block in rank 0's place and rank 0's block in "
     "rank 1's place", None),
]
# each case in both modes under `-m sweep`; CI runs each mechanism once (6 runs, each mode covering a
# reduce-scatter and an all-gather, on every rank and on one)
SP_CI = {("rs-scaled@2", "full"), ("rs-own@1:1", "fingerprint"), ("rs-other@0", "full"), ("ag-stale@2", "fingerprint"),
         ("ag-stale@3:0", "full"), ("ag-swap@1", "fingerprint")}
SP_PARAMS = [pytest.param(*c, mode, id=f"{c[0]}-tp{c[1]}-{mode}",
                          marks=() if (c[0], mode) in SP_CI else pytest.mark.sweep)
             for c in SP for mode in ("full", "fingerprint")]


def assert_collective_named(rep, collective, layer, ranks, says, nproc, exchange, out):
    """The one failure: `allreduce-incomplete` at the collective (kind, number, path, layer, module,
    ranks), in words that fit it; every other collective of the run complete; in fingerprint mode
    proven from the sketches alone (no tensor moved beyond the diverging stream points' detail)."""
    kind = {RS: "reduce_scatter", AG: "all_gather"}[collective]
    seq = 2 * layer + (1 if kind == "reduce_scatter" else 2)
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [("allreduce-incomplete", f"layer {layer} (blocks.{layer})", ranks)], \
        [f["line"] for f in rep["findings"]]
    f = failures(rep)[0]
    c10d = "c10d._reduce_scatter_base_" if kind == "reduce_scatter" else "c10d._allgather_base_"
    assert f["detail"].startswith(f"{collective} #{seq} (tests.zoo.sp_comm.Comm.{kind}+{c10d}"), f["detail"]
    defn = "its slice of the sum" if kind == "reduce_scatter" else "the concatenation"
    assert f"ran, but its output is not {defn} of its inputs: " in f["detail"], f["detail"]
    assert says in f["detail"], f["detail"]
    assert "all-reduce" not in f["detail"] and "the this" not in f["detail"]
    assert f["explain"].startswith(f"{'a' if kind == 'reduce_scatter' else 'an'} {collective} ran and returned"), \
        f["explain"]
    ev = f["evidence"]
    assert (ev["seq"], ev["kind"], ev["op"]) == (seq, kind, "SUM" if kind == "reduce_scatter" else "CAT")
    ar = rep["allreduce"]
    assert [e["seq"] for e in ar["records"] if e["level"] == "incomplete"] == [seq], ar["records"]
    assert ar["incomplete"] == 1 and ar["unchecked"] == 0 and ar["checked"] == 1 + 2 * 4
    assert ar["method"] == ("sketch" if exchange == "fingerprint" else "tensors")
    assert sorted(int(r) for r, p in ev["per_rank"].items() if p["level"] == "material") == ranks
    if kind == "all_gather":       # the wrong blocks, by their sender
        assert all(ev["per_rank"][str(r)]["chunks_wrong"] for r in ranks), ev["per_rank"]
    if exchange == "fingerprint":
        sent, allowed = tensor_bytes_moved(rep, out)
        assert sent == allowed, (sent, allowed)
        if len(ranks) == nproc or kind == "reduce_scatter":
            # the ranks agree (a wrong chunk is all-gathered to every rank): not one tensor byte moved
            assert all(b["tensor_sent"] == b["tensor_received"] == 0
                       for b in rep["exchange"]["bytes_per_rank"].values()), rep["exchange"]
    return f


@pytest.mark.parametrize("fault,nproc,collective,layer,ranks,says,error,exchange", SP_PARAMS)
def test_a_wrong_reduce_scatter_or_all_gather_is_named_exactly(tmp_path, fault, nproc, collective, layer, ranks,
                                                               says, error, exchange):
    rc, rep, cp = probe(tmp_path / "r", "--model", "tests.zoo.sp_comm:wrong", "--exchange", exchange, nproc=nproc,
                        env={"SP_FAULT": fault})
    assert rc == 1, cp.stderr[-3000:]
    f = assert_collective_named(rep, collective, layer, ranks, says, nproc, exchange, tmp_path / "r")
    if error is not None:          # a slice of the sum x 2 is off by exactly 1, from tensors or sketches
        assert all(abs(f["evidence"]["per_rank"][str(r)]["error"] - error) < 1e-4 for r in ranks), f["evidence"]


@pytest.mark.parametrize("exchange,nproc", [("full", 2), pytest.param("fingerprint", 4, marks=pytest.mark.sweep),
                                            pytest.param("full", 4, marks=pytest.mark.sweep), ("fingerprint", 2)])
def test_a_healthy_reduce_scatter_and_all_gather_through_a_communicator_have_no_finding(tmp_path, exchange, nproc):
    rc, rep, cp = probe(tmp_path / "r", "--model", "tests.zoo.sp_comm:healthy", "--exchange", exchange, nproc=nproc)
    assert rc == 0 and rep["findings"] == [], [f["line"] for f in rep["findings"]]
    ar = rep["allreduce"]
    assert [e["kind"] for e in ar["records"]] == ["all_reduce"] + ["reduce_scatter", "all_gather"] * 4
    assert ar["checked"] == 9 and ar["incomplete"] == 0 and ar["unchecked"] == 0
    assert all(e["level"] == "exact" for e in ar["records"] if e["kind"] == "all_gather")
    # the audit line counts them by kind and says each is checked by its own definition (never "all-reduces")
    line = next(ln for ln in render(rep).splitlines() if ln.startswith("all-reduce audit:"))
    assert line.startswith("all-reduce audit: 9 collectives checked (1 all-reduce, 4 reduce-scatters, "
                           "4 all-gathers)"), line
    assert "(the all-gather, reduce-scatter ones by their own definition)" in line and "9 complete" in line, line
    # nor does the verdict call them all-reduces
    assert "HEALTHY: every capture point agrees across ranks and every collective returned what its definition " \
           "says" in render(rep), render(rep)[-1500:]


# ---- a dropped id in a 1-layer model is a missing capture, not a TP slice ------------------------------
@pytest.mark.parametrize("exchange", ["full", pytest.param("fingerprint", marks=pytest.mark.sweep)])
def test_a_dropped_id_whose_width_looks_like_a_tp_slice_is_named_missing(tmp_path, exchange):
    """--num-layers 1 --layers -1,0 at tp 2: id 0 maps past the only layer, so the packed aux holds one
    full-width slot, 64 wide, which is also 2 slots x hidden / tp: the slot equals the embedding, so
    it is no slice."""
    rc, rep, cp = probe(tmp_path / "r", "--num-layers", "1", "--layers", "-1,0", "--exchange", exchange, nproc=2)
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [("missing-capture", "aux slot for id 0", [0, 1])], [f["line"] for f in rep["findings"]]
    assert "maps to layer 1 = num_layers, past the last layer" in failures(rep)[0]["detail"]


# ---- a missing reduce from positive evidence that does not depend on other layers ----------------
# tests/zoo/blocks.py: GPT-J blocks that reduce their own sum, nothing row-parallel by structure, so only
# the data (3b: the partial-sum signature) or another layer's count (3c) can name a missing reduce
SHARES = "the ranks' increments are distinct shares of one sum"
BLOCK = [  # (factory, nproc, exchange, [(kind, where, ranks)], what the first finding's detail says)
    ("drop_all", 2, "full", [("partial-allreduce", "layer 0 (blocks.0)", [0, 1]),
                             ("coverage", "collective audit", [0, 1])], "so only the data show it"),
    ("drop_all", 4, "fingerprint", [("partial-allreduce", "layer 0 (blocks.0)", [0, 1, 2, 3]),
                                    ("coverage", "collective audit", [0, 1, 2, 3])], "every layer alike"),
    ("one_layer", 2, "fingerprint", [("partial-allreduce", "layer 0 (blocks.0)", [0, 1]),
                                     ("coverage", "collective audit", [0, 1])], "a reduce in blocks.0 never ran"),
    ("one_layer", 4, "full", [("partial-allreduce", "layer 0 (blocks.0)", [0, 1, 2, 3]),
                              ("coverage", "collective audit", [0, 1, 2, 3])], "a reduce in blocks.0 never ran"),
    ("first_of_two", 2, "full", [("partial-allreduce", "layer 0 (blocks.0)", [0, 1])], "the other layers issue 1"),
    ("last", 4, "full", [("partial-allreduce", "layer 2 (blocks.2)", [0, 1, 2, 3])], "the other layers issue 1"),
    # the negative control: a rank-dependent computation is not a partial sum, at tp 2 and tp 4
    ("nudged", 2, "full", [("rank-divergence", "layer.0.out", [1])], "differs materially on rank 1"),
    ("nudged", 4, "fingerprint", [("rank-divergence", "layer.0.out", [1])], "differs materially on rank 1"),
]
# CI runs every layer at tp 2, the 1-layer model at tp 4 and the control at tp 2; the sweep tier the rest
BLOCK_PARAMS = [pytest.param(*c, id=f"{c[0]}-tp{c[1]}-{c[2]}",
                             marks=() if (c[0], c[1]) in (("drop_all", 2), ("one_layer", 4), ("nudged", 2))
                             else pytest.mark.sweep) for c in BLOCK]


@pytest.mark.parametrize("factory,nproc,exchange,want,says", BLOCK_PARAMS)
def test_a_missing_reduce_is_named_from_the_partial_sum_signature(tmp_path, factory, nproc, exchange, want, says):
    rc, rep, cp = probe(tmp_path / "r", "--model", f"tests.zoo.blocks:{factory}", "--exchange", exchange,
                        nproc=nproc)
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == want, [f["line"] for f in rep["findings"]]
    f = failures(rep)[0]
    assert says in f["detail"], f["line"]
    assert "weight shard" not in f["explain"], f["explain"]
    if f["kind"] == "partial-allreduce":
        sig = f["evidence"]["partial_sum_signature"]
        assert SHARES in f["detail"] and sig["max_cosine"] < 0.95 and sig["ranks"] == list(range(nproc))
    else:
        assert SHARES not in f["detail"] and "partial_sum_signature" not in f["evidence"]


# tests/zoo/moe_kinds.py: a dense layer 0 (2 reduces) beside MoE layers (3: a shared expert reduced on its own)
@pytest.mark.parametrize("factory,nproc,want", [
    ("healthy", 2, []),
    ("drop_shared", 2, [("partial-allreduce", "layer 2 (layers.2.mlp.shared)", [0, 1])]),
    pytest.param("drop_shared", 4, [("partial-allreduce", "layer 2 (layers.2.mlp.shared)", [0, 1, 2, 3])],
                 marks=pytest.mark.sweep),
])
def test_reduce_counts_are_compared_within_a_layer_kind(tmp_path, factory, nproc, want):
    rc, rep, cp = probe(tmp_path / "r", "--model", f"tests.zoo.moe_kinds:{factory}", "--layers", "-1,1",
                        nproc=nproc)
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == want, [f["line"] for f in rep["findings"]]
    per = rep["coverage"]["reduces_per_place"]
    assert [per[f"layer.{k}"]["0"] for k in range(4)] == ([2, 3, 3, 3] if factory == "healthy" else [2, 3, 2, 3])
    if factory == "healthy":      # the dense layer's 2 is not "a reduce missing" beside the MoE layers' 3
        assert rc == 0 and rep["findings"] == [] and rep["allreduce"]["incomplete"] == 0
        assert rep["allreduce"]["checked"] == len(rep["allreduce"]["records"])
        assert rep["coverage"]["layers_found"] == 4 and rep["coverage"]["embed"]
        return
    assert rc == 1
    f = failures(rep)[0]
    assert "the audit counted 2 reduce(s) in layer 2 where the other layers of its kind issue 3" in f["detail"]
    assert SHARES in f["detail"], f["line"]
