"""`tpprobe report DIR` over the plugins' step folders: the current names, `step-{N:06d}-{mode}`
(the forward mode in the name), and the old ones, `step-{N:06d}`, alike and mixed.

Two real `tpprobe probe` runs (2 gloo ranks: one healthy, one with layer 1's attention all-reduce
skipped) are laid out as a plugin's run of three forwards; the report must check every step, name
the first divergence (step, its forward mode, kind, place, ranks) and take the mode from the
folder's name when the capture's settings do not carry one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpprobe.engines.sglang.plugin import step_dir, step_name

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _probe(out: Path, *extra: str) -> None:
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--out", str(out), "--quiet",
                        *extra], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe-runs")
    _probe(d / "healthy")
    _probe(d / "broken", "--inject", "skip-allreduce@1")
    return d


def _report(path: Path) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(path), "--json"], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def _lay_out(root: Path, runs: Path, folders: list[tuple[str, str]]) -> None:
    for name, which in folders:
        shutil.copytree(runs / which, root / "dp0-pp0" / name, ignore=shutil.ignore_patterns("report.*"))


def test_step_names_carry_the_forward_mode():
    par = {"dp_rank": 1, "pp_rank": 0}
    assert step_dir(Path("/c"), par, 3, "decode") == Path("/c/dp1-pp0/step-000003-decode")
    assert step_name(0, "EXTEND") == "step-000000-extend"
    assert step_name(7, "target_verify") == "step-000007-target_verify"
    assert step_name(7, "draft extend/v2") == "step-000007-draft_extend_v2"
    assert step_name(1, "") == "step-000001-unknown"


@pytest.mark.parametrize("layout", ["new", "old", "mixed"])
def test_report_reads_new_and_old_step_folders(runs, tmp_path, layout):
    names = {"new": ["step-000000-extend", "step-000001-decode", "step-000002-decode"],
             "old": ["step-000000", "step-000001", "step-000002"],
             "mixed": ["step-000000", "step-000001-decode", "step-000002"]}[layout]
    _lay_out(tmp_path, runs, list(zip(names, ["healthy", "broken", "healthy"])))
    code, rep = _report(tmp_path)
    assert code == 1
    modes = [n.split("-")[2] if n.count("-") == 2 else None for n in names]    # old names carry none
    mode1 = modes[1]
    assert [(r["step"], r["failures"] > 0, r["forward_mode"]) for r in rep["steps"]] == \
        [(0, False, modes[0]), (1, True, modes[1]), (2, False, modes[2])]
    d = rep["first_divergence"]
    assert (d["group"], d["step"], d["forward_mode"]) == ("dp0-pp0", 1, mode1), d
    assert (d["kind"], d["ranks"]) == ("partial-allreduce", [0, 1]) and "layers.1" in d["where"], d
    # one step alone, by its folder: exactly the probe's own report of that run
    code, one = _report(tmp_path / "dp0-pp0" / names[1])
    assert code == 1 and [f["kind"] for f in one["findings"] if f["severity"] == "failure"][0] == "partial-allreduce"


def test_healthy_steps_of_both_layouts_report_healthy(runs, tmp_path):
    _lay_out(tmp_path, runs, [("step-000000", "healthy"), ("step-000001-decode", "healthy")])
    code, rep = _report(tmp_path)
    assert code == 0 and [f for f in rep["findings"] if f["severity"] == "failure"] == []
    assert [(r["step"], r["failures"], r["forward_mode"]) for r in rep["steps"]] == [(0, 0, None), (1, 0, "decode")]
    assert rep["settings"]["steps checked"] == "2 in 1 TP group(s), 0 with failures"
    assert rep["settings"]["step shown"] == "1 (decode) in dp0-pp0"


def test_each_steps_manifest_is_read_once_and_an_earlier_servers_steps_are_set_aside(runs, tmp_path, monkeypatch,
                                                                                       capsys):
    """Steps 0 and 1 written by an earlier server, step 0 again and step 2 by the latest (the plugin's "server run"
    in each manifest's settings): the report checks the latest server's steps only and names the others; every
    step folder's manifest is read once, for its server and its checks alike."""
    from tpprobe.cli.report import check_dir
    from tpprobe.cli.steps import report_steps
    names = [("step-000000-extend", "healthy"), ("step-000001-decode", "broken"), ("step-000002-decode", "healthy")]
    _lay_out(tmp_path, runs, names)
    old, new = "2026-12-01T10:00:00Z on vm, pid 1", "2026-12-02T10:00:00Z on vm, pid 2"
    for name, run in (("step-000000-extend", new), ("step-000001-decode", old), ("step-000002-decode", new)):
        m = tmp_path / "dp0-pp0" / name / "manifest.json"
        doc = json.loads(m.read_text())
        doc["settings"]["server run"] = run
        m.write_text(json.dumps(doc))
    reads: dict = {}

    def counting(real):
        def read(self, *a, **k):
            if self.name == "manifest.json":
                reads[self.parent.name] = reads.get(self.parent.name, 0) + 1
            return real(self, *a, **k)
        return read
    for how in ("read_text", "read_bytes"):        # every way a manifest is read
        monkeypatch.setattr(Path, how, counting(getattr(Path, how)))
    code = report_steps(tmp_path, check_dir, json_out=True)
    rep = json.loads(capsys.readouterr().out)
    assert code == 0 and [(r["step"], r["failures"]) for r in rep["steps"]] == [(0, 0), (2, 0)], rep["steps"]
    assert rep["stale_steps"] == [{"folder": str(tmp_path / "dp0-pp0" / "step-000001-decode"), "server run": old}]
    assert reads == {name: 1 for name, _ in names}, reads
