"""Bad input ends in one line that says what is wrong and what to do, exit 2, nothing left behind;
and what a command prints never misleads: no silent change of what was asked, no stale verdict.

Every case is the real CLI: `tpprobe.cli.main` in this process (the console script's own argv
handling and error printing), or `python -m tpprobe` where ranks or a clean interpreter are needed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import ROOT, probe, run_cli
from tpprobe.cli import main


def cli(args: list[str], cap) -> tuple[int, str, str]:
    """main(args) in this process: (exit code, stdout, stderr)."""
    cap.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = cap.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tpprobe: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """One healthy 2-rank capture of the built-in model (the real CLI, gloo)."""
    out = tmp_path_factory.mktemp("bad_input") / "run"
    code, rep, cp = probe(out)
    assert code == 0, cp.stderr[-2000:]
    return out


# ---- tpprobe torchrun: its own options checked before torchrun starts anything --------------------
@pytest.mark.parametrize("args, says", [
    (["--nproc-per-node", "0", "probe"], "--nproc-per-node '0': give the ranks per node, a number >= 1"),
    (["--nproc-per-node", "abc", "probe"], "--nproc-per-node 'abc': give the ranks per node, a number >= 1"),
    (["--nproc-per-node=-2", "probe"], "--nproc-per-node '-2': give the ranks per node, a number >= 1"),
    # probe's own --nproc after the command: never matched against torchrun's option names
    (["probe", "--nproc", "0"], "probe --nproc starts ranks itself; under torchrun the ranks are torchrun's: "
                                "put --nproc-per-node N before probe"),
    (["--nproc-per-node", "2", "probe", "--nproc=4"], "probe --nproc starts ranks itself"),
])
def test_torchrun_options_that_cannot_work_are_one_line_exit_2(capsys, args, says):
    code, out, err = cli(["torchrun", *args], capsys)
    assert code == 2, err
    assert says in one_line(err)
    assert "ambiguous" not in err


# ---- report sinks: a folder given for a file -------------------------------------------------------
@pytest.mark.parametrize("flag", ["--markdown", "--html"])
def test_report_sink_that_is_a_folder_is_refused_and_leaves_no_temporary(capture, tmp_path, monkeypatch, capsys,
                                                                          flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sink").mkdir()
    code, out, err = cli(["report", capture, flag, "sink"], capsys)
    assert code == 2, err
    name = "report.md" if flag == "--markdown" else "report.html"
    assert one_line(err) == f"tpprobe: error: {flag} sink is a folder; give a file name, e.g. {flag} sink/{name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sink"] and not list((tmp_path / "sink").iterdir())


def test_a_write_that_fails_leaves_no_temporary_beside_its_target(tmp_path):
    from tpprobe.formats.capture_dir import atomic_write_bytes
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "taken", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ---- a damaged capture folder: what is damaged, in one line; never the folder's old verdict ---------
def _damage(d: Path, how: str) -> str:
    if how == "truncated":
        p = d / "rank-001.safetensors"
        p.write_bytes(p.read_bytes()[:1000])
        return "rank-001.safetensors (rank 1): size 1000 bytes, manifest says"
    if how == "missing":
        (d / "rank-001.safetensors").unlink()
        return "rank-001.safetensors (rank 1): missing"
    p = d / "rank-001.json"
    p.write_text("{broken")
    return "rank-001.json (rank 1): size 7 bytes, manifest says"


@pytest.mark.parametrize("how", ["truncated", "missing", "broken-json"])
def test_a_damaged_capture_folder_is_one_line_naming_the_damage_exit_2(capture, tmp_path, capsys, how):
    d = tmp_path / "copy"
    shutil.copytree(capture, d)
    assert json.loads((d / "report.json").read_text())["exit_code"] == 0     # the folder's own, older verdict
    says = _damage(d, how)
    code, out, err = cli(["report", d], capsys)
    assert code == 2, out + err
    line = one_line(err)
    assert line.startswith(f"tpprobe: error: {d}: damaged capture folder, nothing compared: {says}"), line
    assert line.endswith("rank 0 is still readable (--json shows them); re-run the probe or copy the folder again")
    assert out == "" and "HEALTHY" not in err and "report.json" not in err
    code, out, err = cli(["report", d, "--json"], capsys)          # scripts still get every readable rank
    rep = json.loads(out)
    assert code == 2 and rep["exit_code"] == 2
    assert [f["where"] for f in rep["findings"] if f["kind"] == "capture-file"] == [says.split(" ")[0]]


def test_an_offline_report_never_points_at_the_folders_own_report_json(capture, capsys):
    code, out, err = cli(["report", capture], capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "captures and report.json" not in flat
    assert f"captures: {capture} (this report is read from them and not saved)" in flat
