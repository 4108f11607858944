"""A crash in tpprobe's own code is never a finding and never a wall of tracebacks.

Each run is the real CLI starting two gloo ranks; tests/zoo/crash.py breaks one of tpprobe's
own steps on rank 1 (a name tpprobe calls made unusable, so the error is raised in tpprobe's frame).
The run must end with exit 3 and one line `tpprobe: internal error on rank R in STEP: ...` (the
--debug hint, how to report), and the live rank's report must name the rank and the step. A model
that raises by itself is the model's error (exit 1), and the other rank's collective that fails
because of it is listed under it, not as a failure of its own."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.ranks import run_cli

MODELS = "tests.zoo.crash"
RUNS = {"write": ["crash_in_write"], "forward": ["crash_in_forward"], "report": ["crash_in_report"],
        "model": ["model_raises"],
        "debug": ["crash_in_write", "--debug"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("internal")

    def one(name):
        model, *extra = RUNS[name]
        out = base / name
        cp = run_cli(["probe", "--model", f"{MODELS}:{model}", "--layers", "0,1", "--timeout", "8",
                      "--out", str(out), *extra], timeout=120)
        rep = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
        return name, (cp, rep)
    with ThreadPoolExecutor(2) as pool:
        got = dict(pool.map(one, RUNS))
    got["folders"] = base       # each run's folder: base / its name
    return got


def _internal_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("tpprobe: internal error")]


@pytest.mark.parametrize("step", ["write", "forward"])
def test_an_internal_error_on_one_rank_ends_with_one_line_exit_3_and_the_live_rank_names_it(runs, step):
    cp, rep = runs[step]
    assert cp.returncode == 3, cp.stderr[-2000:]
    lines = _internal_lines(cp.stderr)
    assert len(lines) == 1, cp.stderr[-2000:]
    assert lines[0].startswith(f"tpprobe: internal error on rank 1 in {step}: TypeError: ")
    assert "run with --debug for the traceback" in lines[0] and "please report it" in lines[0]
    assert "Traceback" not in cp.stderr and "Traceback" not in cp.stdout
    found = [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"]
    assert found == [("internal-error", step, [1])]
    assert "HEALTHY" not in cp.stdout
    # the embedding was found (write) or the forward stopped before it returned (forward): never "NOT FOUND"
    assert "NOT FOUND" not in cp.stdout


def test_checks_that_crash_leave_a_folder_the_report_command_reads(runs):
    # rank 0's checks fail after every rank's capture is written: exit 3, one line, and nothing lost
    cp, _ = runs["report"]
    assert cp.returncode == 3, cp.stderr[-2000:]
    [line] = _internal_lines(cp.stderr)
    assert line.startswith("tpprobe: internal error on rank 0 in report: TypeError: ")
    out = runs["folders"] / "report"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ranks"] == [0, 1] and {f["rank"] for f in manifest["files"]} == {0, 1}
    again = run_cli(["report", str(out), "--json"], timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    rep = json.loads(again.stdout)
    assert rep["findings"] == [] and rep["allreduce"]["checked"] == 3 and rep["allreduce"]["unchecked"] == 0


def test_with_debug_the_internal_error_shows_its_traceback_and_no_debug_hint(runs):
    cp, _ = runs["debug"]
    assert cp.returncode == 3
    assert "Traceback" in cp.stderr
    line = _internal_lines(cp.stderr)[-1]
    assert "run with --debug" not in line and "please report it" in line


def test_a_model_that_raises_is_the_models_error_and_the_peers_failed_collective_is_its_consequence(runs):
    cp, rep = runs["model"]
    assert cp.returncode == 1, cp.stderr[-2000:]
    assert not _internal_lines(cp.stderr)
    fails = [f for f in rep["findings"] if f["severity"] == "failure"]
    assert [(f["kind"], f["ranks"]) for f in fails] == [("rank-error", [1])]
    assert "ValueError: the model's own bug in layer 1" in fails[0]["detail"]
    assert any(c.startswith("rank 0: its collective failed once the peer stopped") for c in fails[0]["consequences"])


def test_an_internal_error_in_an_offline_command_is_one_line_and_exit_3(runs):
    # `tpprobe report` with its reader broken the way a bug breaks it (the name it calls is unusable)
    import subprocess
    import sys
    from tests.helpers.ranks import ROOT
    out = runs["write"][0].args[runs["write"][0].args.index("--out") + 1]
    code = ("import sys, tpprobe.cli.report as o; o.report_dir = None; from tpprobe.cli import main; "
            f"main(['report', {out!r}])")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cp.returncode == 3, cp.stderr
    assert cp.stderr.strip().splitlines() == [
        line for line in cp.stderr.strip().splitlines()
        if line.startswith("tpprobe: internal error in tpprobe report: TypeError")]
    assert "Traceback" not in cp.stderr
