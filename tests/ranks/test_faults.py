"""Every fault of the catalogue (F1–F15), injected into the built-in model, named exactly.

Each case asserts the exact diagnosis: one failure finding of the right kind, at the right
place, on the right ranks, and the exit code. rank-noise must come out as info-level noise only.
The last test builds docs/faults.md's fault table from these same runs (scripts/fault_table.py's
`table`) and compares: the table cannot drift, and CI makes no extra runs for it.
"""
import importlib.util
import re
import time
from pathlib import Path

import pytest

from tests.conftest import LAUNCHES, ranks_for
from tests.helpers.ranks import failures
from tests.helpers.ranks import probe as _probe

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fault_table", ROOT / "scripts" / "fault_table.py")
fault_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault_table)

RUNS: dict = {}   # fault_table.key(inject, args) -> (exit code, report): every run this file made


def probe(out, *args, nproc: int = 2, **kw):
    """tests.helpers.ranks.probe, remembering each --inject run on gloo via --nproc for the fault table."""
    rc, rep, cp = _probe(out, *args, nproc=nproc, **kw)
    if "--inject" in args and kw.get("backend", "gloo") in ("", "gloo") and not kw.get("torchrun"):
        rest = list(args)
        inject = rest.pop(rest.index("--inject") + 1)
        rest.remove("--inject")
        RUNS[fault_table.key(inject, ["--nproc", str(nproc), *rest])] = (rc, rep)
    return rc, rep, cp


MADE: dict = {}   # (args, nproc, backend, torchrun) -> (exit code, report, process, folder) of each probe_once run


def probe_once(out, *args, nproc: int = 2, backend: str = "", torchrun: bool = False):
    """probe(), made once per module for the same arguments: a second test of the same run reads the
    first one's report and folder (it makes the run itself when it is picked alone)."""
    key = (args, nproc, backend, torchrun)
    if key not in MADE:
        MADE[key] = (*probe(out, *args, nproc=nproc, backend=backend, torchrun=torchrun), out)
    return MADE[key]


# (inject, nproc, extra args, kind, where, ranks)
CASES = [
    ("skip-embed-allreduce", 2, [], "partial-allreduce", "embedding (embed_tokens)", [0, 1]),
    ("skip-allreduce@2", 2, [], "partial-allreduce", "layer 2 (layers.2.self_attn.o_proj)", [0, 1]),
    ("subgroup-allreduce@1", 4, [], "subgroup-allreduce", "layer 1 (layers.1.self_attn.o_proj)", [0, 1, 2, 3]),
    ("rank-weight@1", 2, [], "rank-divergence", "layer 3 parameter layers.3.input_layernorm.weight", [1]),
    ("slice-capture", 2, [], "tp-sliced", "aux.packed", [0, 1]),
    ("capture-offset", 2, [], "capture-offset", "aux slots [1, 2]", [0, 1]),
    ("drop-embed-slot", 2, [], "slot-mismatch", "aux slots [0, 1, 2]", [0, 1]),
    ("slot-order", 2, [], "slot-mismatch", "aux slots [0, 1]", [0, 1]),
    ("alias-capture", 2, [], "aliased-capture", "aux slots [0, 1, 2]", [0, 1]),
    ("nan@1", 2, [], "non-finite", "layer.3.out", [1]),
    ("capture-dtype@1", 2, ["--dtype", "bfloat16"], "dtype-mismatch", "aux.packed", [1]),
    ("capture-noncontig", 2, [], "layout-mismatch", "aux.packed", [0, 1]),
    ("extra-collective@1", 2, ["--timeout", "20"], "collective-mismatch", "layer.3", [1]),
    ("embed-after-norm", 2, [], "transformed-capture", "aux slot 0", [0, 1]),
    ("kill-rank@1", 2, ["--timeout", "15"], "rank-timeout", "forward", [1]),
    ("drop-last-id", 2, [], "missing-capture", "aux slot for id 5", [0, 1]),
    ("skip-allreduce@0", 4, [], "partial-allreduce", "layer 0 (layers.0.self_attn.o_proj)", [0, 1, 2, 3]),
    ("rank-weight@3", 4, [], "rank-divergence", "layer 3 parameter layers.3.input_layernorm.weight", [3]),
    ("nan@2", 4, [], "non-finite", "layer.3.out", [2]),
]


@pytest.mark.parametrize("inject,nproc,extra,kind,where,ranks", CASES, ids=[f"{c[0]}-tp{c[1]}" for c in CASES])
def test_fault_is_named_exactly(tmp_path, backend, inject, nproc, extra, kind, where, ranks):
    rc, rep, cp, _ = probe_once(tmp_path / "r", "--inject", inject, *extra, nproc=ranks_for(backend, nproc),
                                backend=backend)
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert got == [(kind, where, ranks)], rep.get("findings")
    assert rep["findings"][0]["explain"], "every kind explains itself in one sentence"
    if kind == "non-finite":     # the NaN the next reduce spread to every rank is listed under the root
        cons = rep["findings"][0]["consequences"]
        assert [c.split(":")[0] for c in cons[:2]] == ["layer.4.out", "layer.5.out"], cons
        assert all(" NaN and 0 Inf values on every rank" in c for c in cons[:2]), cons


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_or_two_ulp_on_one_rank_is_rounding_noise_not_a_failure(tmp_path, dtype):
    rc, rep, _ = probe(tmp_path / "r", "--inject", "rank-noise@1", "--dtype", dtype)
    assert rc == 0
    assert failures(rep) == []
    [f] = rep["findings"]
    assert f["kind"] == "rounding-noise" and f["severity"] == "info" and f["ranks"] == [1]


@pytest.mark.parametrize("backend,torchrun", LAUNCHES)
def test_a_hung_rank_stops_the_others_within_the_timeout(tmp_path, backend, torchrun):
    t0 = time.time()
    rc, rep, cp = probe(tmp_path / "r", "--inject", "hang-rank@1", "--timeout", "10", backend=backend,
                        torchrun=torchrun)
    took = time.time() - t0
    assert rc == 1 and took < 10 + 15, (took, cp.stderr[-2000:])
    [f] = failures(rep)
    assert (f["kind"], f["ranks"]) == ("rank-timeout", [1]) and "hung" in f["detail"]
    assert rep["ranks_missing"] == [1]
    assert rep["timings"]["total_s"] - rep["timings"]["start_s"] < 10 + 6, rep["timings"]
    if backend == "nccl":   # the last collective each rank's GPU completed, and the flight recorder
        assert "its GPU had completed" in f["detail"] or "flight recorder" in f["detail"], f["detail"]


@pytest.mark.parametrize("backend,torchrun", LAUNCHES)
def test_a_killed_rank_leaves_the_live_ranks_capture_written(tmp_path, backend, torchrun):
    # on gloo through --nproc: the run of test_fault_is_named_exactly's kill-rank@1 case, made once
    rc, rep, cp, out = probe_once(tmp_path / "r", "--inject", "kill-rank@1", "--timeout", "15", backend=backend,
                                  torchrun=torchrun)
    assert rc == 1 and rep.get("ranks_missing") == [1], cp.stderr[-3000:]
    [f] = failures(rep)
    assert (f["kind"], f["ranks"]) == ("rank-timeout", [1]) and "died" in f["detail"]
    assert rep["timings"]["total_s"] - rep["timings"]["start_s"] < 15 + 6, rep["timings"]
    assert (out / "rank-000.safetensors").exists() and (out / "manifest.json").exists()


@pytest.mark.parametrize("backend,torchrun", LAUNCHES[2:])    # gloo and NCCL via --nproc: CASES
def test_an_extra_collective_is_named_not_a_timeout(tmp_path, backend, torchrun):
    rc, rep, cp = probe(tmp_path / "r", "--inject", "extra-collective@1", "--timeout", "20", backend=backend,
                        torchrun=torchrun)
    assert rc == 1, cp.stderr[-3000:]
    [f] = failures(rep)
    assert (f["kind"], f["where"], f["ranks"]) == ("collective-mismatch", "layer.3", [1]), rep["findings"]
    assert "extra all-reduce" in f["detail"]


def test_ids_out_of_layer_order_are_named_since_the_model_packs_in_layer_order(tmp_path):
    # SGLang (and the built-in model) append each capture as its layer runs: ids 4,-1,2 give
    # [embed, layer 2, layer 4], not the order the ids were written in
    rc, rep, _ = probe(tmp_path / "r", "--layers", "4,-1,2")
    assert rc == 1
    [f] = failures(rep)
    assert (f["kind"], f["where"], f["ranks"]) == ("slot-mismatch", "aux slots [0, 1, 2]", [0, 1])
    assert "not in layer order" in f["detail"]


_NOISE_NUMBERS = re.compile(r"worst element ([0-9.]+) ULP, relative error ([0-9.e+-]+)")


def _noise_masked(table: str) -> str:
    for ulp, rel in _NOISE_NUMBERS.findall(table):
        assert float(ulp) <= 8 and float(rel) < 1e-6, (ulp, rel)     # still rounding: a few ULP at most
    return _NOISE_NUMBERS.sub("worst element N ULP, relative error E", table)


def test_the_fault_table_in_the_docs_is_what_these_runs_print(tmp_path):
    """Runs here reuse every run above (a run missing, when this test is picked alone, is made)."""
    for inject, extra in fault_table.RUNS:
        k = fault_table.key(inject, extra)
        if k not in RUNS:
            RUNS[k] = fault_table.run(inject, extra, tmp_path / str(len(RUNS)))
    # a rounding-noise row's worst ULP and relative error are the host's matmul kernels' rounding (2.0 ULP
    # on one CPU of this machine kind, 4.0 on another): compared as rounding, not digit for digit
    want, have = (_noise_masked(t) for t in (fault_table.table(RUNS),
                                             fault_table.page_table(fault_table.PAGE.read_text())))
    differ = [(h, w) for h, w in zip(have.splitlines(), want.splitlines()) if h != w]
    assert have == want, ("docs/faults.md's fault table differs from the runs (python scripts/fault_table.py --write): "
                          f"{differ[:3] or 'rows added or missing'}")
