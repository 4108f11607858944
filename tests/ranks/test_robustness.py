"""Broken ranks never hang the probe, nothing captured is lost, and disagreement is a finding.

Every run here is the real CLI (`python -m tpprobe probe`) starting real gloo ranks through
PyTorch's elastic launcher; nothing of torch.distributed is mocked. The runs are started together
(a few at a time: this is meant to fit a 2-core CI box) by one module fixture, then each test reads
its run's exit code, wall time, report.json, manifest and an offline `tpprobe report` of the folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import gpu_count
from tpprobe.formats.capture_dir import load_run

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 8            # --timeout of the fault runs
# The tight bound is the ranks' own clock (report.json timings: total_s - start_s, from every rank
# ready to the verdict) < TIMEOUT + 6. The wall-clock bound only guards against a hang: it also holds the
# launcher's and the ranks' interpreter + torch start-up, slow on a shared 2-core box.
MARGIN = 60
MODELS = "tests.zoo.disagree"

RUNS = {
    # name: (nproc, extra args); over NCCL a run gets at most one rank per GPU (kill4: 2 ranks,
    # kill-rank@1, on a 2-GPU machine)
    "kill4": (4, ["--inject", "kill-rank@2"]),
    "hang": (2, ["--inject", "hang-rank@1"]),
    "extra": (2, ["--inject", "extra-collective@1"]),
    "nan": (2, ["--inject", "nan@1"]),
    # rank 1 captures an extra point, a narrower one, a float64 one, and issues an all-reduce of
    # another shape (tests/zoo/disagree.py:disagree)
    "disagree": (2, ["--model", f"{MODELS}:disagree"]),
}


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    return e


def tpprobe(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpprobe", *map(str, args)], capture_output=True, text=True,
                          env=env(), cwd=ROOT, timeout=timeout)


def plan(name: str, backend: str) -> tuple[int, list, int]:
    """(ranks, args, the broken rank) of a run on this backend."""
    nproc, extra = RUNS[name]
    if backend == "nccl" and nproc > gpu_count():
        nproc = gpu_count()
        extra = [a.replace("@2", f"@{nproc - 1}") for a in extra]
    return nproc, extra, (nproc // 2 if name == "kill4" else 1)


def _probe(name: str, base: Path, backend: str) -> dict:
    nproc, extra, _ = plan(name, backend)
    out = base / name
    t0 = time.time()
    p = tpprobe("probe", "--nproc", nproc, "--out", out, "--quiet", "--timeout", TIMEOUT, "--backend", backend,
                *extra, timeout=TIMEOUT + 120)
    wall = time.time() - t0
    rep = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    return {"rc": p.returncode, "stderr": p.stderr, "wall": wall, "out": out, "report": rep}


def offline(out: Path, capsys) -> tuple[int, dict]:
    """`tpprobe report DIR --json`, in this process (the CLI's own main())."""
    from tpprobe.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["report", str(out), "--json"])
    cap = capsys.readouterr()
    return e.value.code, (json.loads(cap.out) if cap.out.strip() else {"stderr": cap.err})


@pytest.fixture(scope="module", params=[pytest.param("gloo"), pytest.param("nccl", marks=pytest.mark.gpu)])
def runs(tmp_path_factory, request):
    """Every run on one backend: gloo in CI, NCCL on a GPU machine (`pytest -m gpu`; the runs go
    one after another there, each holding all the GPUs)."""
    backend = request.param
    if backend == "nccl" and gpu_count() < 2:
        pytest.skip("NCCL at tp >= 2 needs 2 GPUs; this machine has fewer (the fingerprint GPU tests still run)")
    base = tmp_path_factory.mktemp(f"robust-{backend}")
    with ThreadPoolExecutor(max_workers=len(RUNS) if backend == "gloo" else 1) as pool:
        futs = {n: pool.submit(_probe, n, base, backend) for n in RUNS}
        got = {n: f.result() for n, f in futs.items()}
    for n, r in got.items():
        r["nproc"], _, r["dead"] = plan(n, backend)
    return got


def kinds(rep: dict) -> dict[str, list[int]]:
    return {f["kind"]: f["ranks"] for f in rep["findings"]}


def assert_bounded(r: dict) -> None:
    assert r["wall"] < TIMEOUT + MARGIN, f"took {r['wall']:.1f} s with --timeout {TIMEOUT}"
    # the ranks' own clock: from every rank ready to the verdict, within the timeout plus the grace
    # (start_s is the launch: interpreter, init and the wait for the slowest peer to start)
    tm = r["report"]["timings"]
    assert 0 < tm["start_s"] < tm["total_s"] and tm["total_s"] - tm["start_s"] < TIMEOUT + 6, tm


def assert_live_ranks_kept(r: dict, dead: int, world: int, capsys) -> None:
    """What the live ranks captured is written and verifies; the report says who is missing."""
    run = load_run(r["out"])
    # a stalled rank whose collective timed out may still write its files after rank 0 sealed the
    # manifest: they are named as extra (never loaded as if verified); nothing else may be off
    stem = f"rank-{dead:03d}."
    assert all(p["file"].startswith(stem) and "extra" in p["problem"] for p in run.problems), run.problems
    assert sorted(run.records) == [q for q in range(world) if q != dead]
    for q in run.records.values():
        assert q.tensors and "embed.out" in q.tensors
    assert r["report"]["ranks_missing"] == [dead]
    rc, off = offline(r["out"], capsys)
    assert rc == 1, off
    # the folder keeps the live run's diagnosis of the missing rank (manifest liveness), not a
    # bare "no file": the same first failure, the same rank, and no capture-file finding for it
    live = [(f["kind"], f["ranks"]) for f in r["report"]["findings"] if f["severity"] == "failure"]
    got = [(f["kind"], f["ranks"]) for f in off["findings"] if f["severity"] == "failure"]
    assert got and got[0] == live[0] and got[0][1] == [dead], (live, off["findings"])
    assert not [f for f in off["findings"] if f["kind"] == "capture-file" and f["severity"] == "failure"]
    healthy = {p["name"]: p["per_rank"] for p in off["points"]}
    assert all(str(q) in healthy["embed.out"] for q in run.records)


@pytest.mark.parametrize("name,kind", [
    ("kill4", "rank-timeout"),
    ("hang", "rank-timeout"),
    ("extra", "collective-mismatch"),
])
def test_broken_rank_is_named_within_the_timeout(runs, name, kind, capsys):
    r = runs[name]
    dead, world = r["dead"], r["nproc"]
    assert r["rc"] == 1, r["stderr"][-2000:]
    assert r["report"] is not None, "rank 0 wrote no report"
    assert_bounded(r)
    k = kinds(r["report"])
    assert k.get(kind) == [dead], r["report"]["findings"]
    line = next(f["line"] for f in r["report"]["findings"] if f["kind"] == kind)
    assert f"rank {dead}" in line
    if name.startswith("hang"):
        assert "hung" in line or "blocked" in line
    if name.startswith("kill"):
        assert "died" in line
    if name == "extra":
        assert "extra all-reduce" in line
    assert_live_ranks_kept(r, dead, world, capsys)


def test_no_rank_outlives_the_launcher(runs):
    """A hung rank is ended, not left behind: no process still runs with a fault run's folder."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if any(str(runs[n]["out"]) in line for n in RUNS)]
    assert left == []


def test_nan_is_a_finding_not_a_crash(runs, capsys):
    r = runs["nan"]
    assert r["rc"] == 1 and "Traceback" not in r["stderr"]
    assert kinds(r["report"]).get("non-finite") == [1]
    rc, off = offline(r["out"], capsys)
    assert rc == 1 and kinds(off).get("non-finite") == [1]


DISAGREE = {"extra.rank1_only": "no such point", "extra.shape": "[16, 32]", "extra.dtype": "float64"}


def _mismatches(rep: dict) -> dict[str, dict]:
    return {f["where"]: f for f in rep["findings"] if f["kind"] == "capture-mismatch"}


def test_disagreeing_captures_are_findings_offline(runs, capsys):
    """Different capture count / names, shapes, dtypes: never a hang, a finding naming rank 1."""
    r = runs["disagree"]
    assert r["report"] is not None and r["wall"] < TIMEOUT + MARGIN
    rc, off = offline(r["out"], capsys)
    assert rc == 1
    got = _mismatches(off)
    for point, text in DISAGREE.items():
        assert point in got and got[point]["ranks"] == [1] and text in got[point]["line"], got


def test_disagreeing_captures_are_findings_live(runs):
    r = runs["disagree"]
    got = _mismatches(r["report"])
    assert r["rc"] == 1 and set(DISAGREE) <= set(got) and all(got[p]["ranks"] == [1] for p in DISAGREE)


def test_collective_of_another_shape_is_a_finding(runs):
    r = runs["disagree"]
    assert r["rc"] == 1 and r["wall"] < TIMEOUT + MARGIN
    f = next(f for f in r["report"]["findings"] if f["kind"] == "collective-mismatch")
    assert f["ranks"] == [1] and "[64, 16]" in f["line"] and "[16, 64]" in f["line"]
