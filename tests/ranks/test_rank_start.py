"""Ranks are started so that nothing a model factory does can break them or hang the run.

- No fork into threads: a factory that runs torch ops on a pool of its own threads while it builds
  the model (what transformers' weight loader does) is healthy many times in a row, through the
  CLI's launcher (forked ranks, their intra-op pool rebuilt first) and through the test runner
  (ranks forked from a clean fork server, never from pytest).
- Ranks share the cores: unless OMP_NUM_THREADS is set, each of N ranks runs torch on cores // N
  threads (at least 1), forked or spawned, as torchrun gives each rank one; a set value stands.
- Nothing waits forever: a rank that ignores SIGTERM and blocks forever is killed with SIGKILL after
  a short grace by whoever started it, the launcher as well as the test runner, and the run ends.
Real processes, real gloo; the factories are in tests/zoo/threads.py.
"""
from __future__ import annotations

import os
import time

import pytest

from tests.helpers import ranks
from tests.helpers.ranks import probe, run_cli, spawn
from tests.zoo import threads

ROUNDS = 4           # in CI; the sweep runs ROUNDS_SWEEP


def _healthy(rc, rep, cp):
    assert rc == 0 and rep["findings"] == [], cp.stdout[-2000:] + cp.stderr[-3000:]
    cov = rep["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == 6 and cov["embed"] == "embed_tokens" and cov["audit"], cov
    assert rep["allreduce"]["incomplete"] == 0 and rep["allreduce"]["complete"] == rep["allreduce"]["checked"] > 0
    assert "Invalid thread pool" not in cp.stderr and "Traceback" not in cp.stderr


def _cli_rounds(tmp_path, n):
    for i in range(n):
        _healthy(*probe(tmp_path / f"r{i}", "--model", "tests.zoo.threads:pool_loader", nproc=2, timeout=180))


def _runner_rounds(n):
    for _ in range(n):
        got = spawn(threads.pool_loader_rank, 2, timeout=120)
        assert sorted(got) == [0, 1] and all(v >= 1 for v in got.values())


def test_a_factory_loading_weights_on_threads_is_healthy_through_the_launcher(tmp_path):
    _cli_rounds(tmp_path, ROUNDS)


def test_a_factory_loading_weights_on_threads_is_healthy_in_the_test_runner():
    _runner_rounds(3 * ROUNDS)


@pytest.mark.sweep
def test_threaded_loading_many_rounds(tmp_path):
    _cli_rounds(tmp_path, 20)
    _runner_rounds(60)


def test_the_test_runner_never_forks_pytest_itself():
    assert ranks.context().get_start_method() in ("forkserver", "spawn")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_that_ignores_sigterm_is_killed_by_the_test_runner(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 failed:(.|\n)*rank 0 fails on purpose"):
        spawn(threads.stubborn_rank, 2, str(pids), timeout=60)
    took = time.monotonic() - start
    assert took < ranks.STOP_GRACE_S + 30, took
    left = [int(p.name) for p in pids.iterdir()]
    assert len(left) == 2
    deadline = time.monotonic() + 10
    while any(map(_alive, left)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in left if _alive(p)] == []


def test_a_rank_that_ignores_sigterm_is_killed_by_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("TPPROBE_STOP_GRACE_S", "3")
    out = tmp_path / "run"
    start = time.monotonic()
    rc, rep, cp = probe(out, "--model", "tests.zoo.threads:stubborn_hang", "--timeout", "6", nproc=2, timeout=120)
    took = time.monotonic() - start
    assert rc == 1, cp.stderr[-3000:]
    got = [(f["kind"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"]
    assert got[0] == ("rank-timeout", [1]), rep["findings"]
    assert took < 90, took
    import subprocess
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert [line for line in ps.splitlines() if str(out) in line] == []


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("nproc, omp", [(2, None), (4, None), (4, "2")])
def test_each_rank_runs_torch_on_its_share_of_the_cores(tmp_path, start, nproc, omp):
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {"THREADS_SEEN_DIR": str(seen), "TPPROBE_RANK_START": start}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    elif "OMP_NUM_THREADS" in os.environ:
        pytest.skip("OMP_NUM_THREADS is set in this environment: the launcher leaves it as it is")
    cp = run_cli(["probe", "--nproc", str(nproc), "--out", str(tmp_path / "r"), "--quiet",
                  "--model", "tests.zoo.threads:threads_seen"], env=env, timeout=180)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    # a set value: what torch makes of it in any process (it takes no more threads than there are cores)
    want = min(int(omp), cores) if omp else max(1, cores // nproc)
    assert {p.name: int(p.read_text()) for p in seen.iterdir()} == {f"rank-{r}": want for r in range(nproc)}
