"""`tpprobe probe`'s own launcher: CPU gloo ranks are forked from it (no interpreter start, no
second torch import), NCCL ranks are spawned through PyTorch's elastic agent; both give the same
report. Real processes, real gloo: the ranks run the whole probe."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.ranks import ROOT, probe

BIG = ("--hidden", "512", "--tokens", "256")     # big enough that the ranks' ops run OpenMP parallel regions


def _same_run(rep: dict) -> dict:
    """What a healthy run measured, less its timings and paths."""
    return {"points": rep["points"], "allreduce": rep["allreduce"], "coverage": rep["coverage"],
            "findings": rep["findings"], "slots": rep["slots"]}


def _healthy(rc, rep, cp):
    assert rc == 0 and rep["findings"] == [], cp.stdout[-2000:] + cp.stderr[-2000:]
    cov = rep["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == 6 and cov["embed"] == "embed_tokens" and cov["audit"], cov
    assert rep["allreduce"]["incomplete"] == 0 and rep["allreduce"]["complete"] == rep["allreduce"]["checked"] > 0


def test_forked_and_spawned_ranks_give_the_same_report(tmp_path, monkeypatch):
    rc, forked, cp = probe(tmp_path / "fork", *BIG, nproc=2)
    _healthy(rc, forked, cp)
    monkeypatch.setenv("TPPROBE_RANK_START", "spawn")
    rc, spawned, cp = probe(tmp_path / "spawn", *BIG, nproc=2)
    _healthy(rc, spawned, cp)
    assert _same_run(forked) == _same_run(spawned)


def _in_launcher(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=ROOT)


PRELUDE = ("import os, sys, threading, torch, tpprobe.cli\n"
           "from tpprobe.probe.launch import start_method, launch_local\n"
           "os.environ['TPPROBE_DIST_BACKEND'] = sys.argv[1] if len(sys.argv) > 1 else 'gloo'\n")


@pytest.mark.parametrize("setting, backend, want", [
    ("", "gloo", "fork"), ("auto", "gloo", "fork"), ("spawn", "gloo", "spawn"), ("fork", "gloo", "fork"),
    ("", "nccl", "spawn"),
    ("fork", "nccl", "tpprobe: error: TPPROBE_RANK_START=fork: only CPU gloo ranks can be forked"),
    ("sometimes", "gloo", "tpprobe: error: TPPROBE_RANK_START='sometimes': say auto, fork or spawn")])
def test_the_start_method_follows_the_backend_and_the_knob(setting, backend, want):
    code = PRELUDE + (f"os.environ['TPPROBE_DIST_BACKEND'] = {backend!r}\n"
                      "from tpprobe.core.errors import TPProbeError\n"
                      "try:\n    print(start_method())\nexcept TPProbeError as e:\n"
                      "    print('tpprobe: error: ' + str(e))\n")
    cp = _in_launcher(code, {"TPPROBE_RANK_START": setting} if setting else None)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert cp.stdout.strip().startswith(want), cp.stdout


def test_a_thread_beside_the_launcher_means_spawn():
    cp = _in_launcher(PRELUDE + "ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()\n"
                                "print(start_method()); ev.set()\n")
    assert cp.stdout.strip() == "spawn", cp.stderr[-2000:]


def test_ranks_forked_after_the_launcher_ran_parallel_torch_ops_do_not_hang(tmp_path):
    """GNU OpenMP's pool does not survive a fork: had the launcher not released it, the ranks'
    first parallel op would hang (this test would time out)."""
    out = tmp_path / "r"
    code = PRELUDE + ("a = torch.randn(1500, 1500); (a @ a).sum(); torch.randn(4_000_000).exp().sum()\n"
                      "assert start_method() == 'fork'\n"
                      f"sys.exit(launch_local(2, ['probe', '--out', {str(out)!r}, '--quiet', *{BIG!r}]))\n")
    cp = _in_launcher(code, timeout=150)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["findings"] == [] and rep["coverage"]["layers_ran"] == 6


# A rank that dies under the fork launcher: tests/ranks/test_robustness.py (kill-rank, hang-rank, ...) runs on it.


def test_no_forked_rank_outlives_a_launcher_that_was_killed(tmp_path):
    """SIGKILL to the launcher (nothing of it runs afterwards): its forked ranks end with it."""
    import signal
    import time
    code = PRELUDE + ("print(os.getpid(), flush=True)\n"
                      f"sys.exit(launch_local(2, ['probe', '--out', {str(tmp_path / 'r')!r}, '--quiet', "
                      "'--inject', 'hang-rank@1']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    launcher = int(p.stdout.readline())
    deadline = time.time() + 60
    ranks = []
    while time.time() < deadline and len(ranks) < 2:
        ranks = [int(t) for t in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True,
                                                 text=True).stdout.split()]
        time.sleep(0.2)
    assert len(ranks) == 2, "the launcher did not fork its two ranks"
    os.kill(launcher, signal.SIGKILL)
    p.wait(10)
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{r}") and
                                         open(f"/proc/{r}/stat").read().split()[2] != "Z" for r in ranks):
        time.sleep(0.1)
    alive = [r for r in ranks if os.path.exists(f"/proc/{r}") and open(f"/proc/{r}/stat").read().split()[2] != "Z"]
    assert alive == [], f"ranks {alive} outlived their launcher"
