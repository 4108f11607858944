"""The CLI's messages and commands as a first-time user meets them: every message useful, every command as documented.

The CLI runs in-process through tpprobe.cli.main (the same argv handling and error printing as the
console script) or typer's CliRunner; runs that start ranks go through the real launcher, whose
ranks inherit this process's stdout/stderr file descriptors (capfd sees what a user sees).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpprobe.cli import app, main

ROOT = Path(__file__).resolve().parents[2]


def cli(args: list[str], cap) -> tuple[int, str, str]:
    """main(args) in this process: (exit code, stdout, stderr) as a user's terminal shows them."""
    cap.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = cap.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tpprobe: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def ranks_env(monkeypatch, tmp_path):
    """Ranks started from here import this checkout (and tests.*), in a scratch working directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- bad input: one line, exit 2, nothing left behind ------------------------------------------
@pytest.mark.parametrize("args, says", [
    (["probe", "--out", "{tmp}/no/such/dir/x"],
     "--out {tmp}/no/such/dir/x: the folder {tmp}/no/such/dir does not exist"),
    (["probe", "--html", "{tmp}/no/such/r.html"], "--html {tmp}/no/such/r.html: the folder {tmp}/no does not exist"),
    (["probe", "--markdown", "{tmp}/no/x/r.md"], "--markdown {tmp}/no/x/r.md: the folder {tmp}/no does not exist"),
    (["report", "{run}", "--html", "{tmp}/no/x/r.html"],
     "--html {tmp}/no/x/r.html: the folder {tmp}/no does not exist"),
    (["specforge", "{run}", "{tmp}/no/rows/d.ckpt"], "the folder {tmp}/no does not exist"),
    (["probe", "--config", "cfg.json"], "--config cfg.json builds SGLang's model classes: add --engine sglang"),
    (["probe", "--num-layers", "0"], "--num-layers must be >= 1 (got 0)"),
    (["probe", "--backend", "nccl"], "--backend nccl needs a CUDA device on every rank; use --backend gloo on CPU"),
    (["specforge"], "Missing argument"),
    (["torchrun", "--bogus", "1", "probe"], "torchrun's options: unrecognized arguments: --bogus"),
    (["torchrun", "--nproc-per-node", "2"], "name the command after torchrun's options"),
])
def test_bad_paths_and_settings_are_one_line_exit_2(args, says, tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # --backend nccl: as on a CPU machine
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"       # a minimal capture folder name; the path checks come before reading it
    run.mkdir()
    fill = lambda s: s.format(tmp=tmp_path, run=run)   # noqa: E731
    code, out, err = cli([fill(a) for a in args], capsys)
    assert code == 2, (out, err)
    assert fill(says) in one_error_line(err)
    assert not (tmp_path / "no").exists(), "a missing parent is never created"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "nothing else is written"


def test_version_and_help_texts_everywhere(capsys):
    from tpprobe import __version__
    from tpprobe.engines.builtin.faults import FAULTS
    assert cli(["--version"], capsys)[:2] == (0, f"tpprobe {__version__}\n")
    import typer.main
    group = typer.main.get_command(app)
    missing = [f"{name} {p.opts[0]}" for name, cmd in group.commands.items() for p in cmd.params
               if p.param_type_name == "option" and not (p.help or "").strip()]
    assert missing == [], f"options without help text: {missing}"
    probe_help = CliRunner().invoke(app, ["probe", "--help"], terminal_width=400).output
    flat = " ".join(probe_help.replace("│", " ").split())
    for name, (_, kind, required) in FAULTS.items():
        assert name + ("@K" if kind == "layer" and required else "@R" if required else "") in flat, name
    assert "NAME@K (K a layer) or NAME@R (R a rank)" in flat
    code, out, _ = cli(["specforge", "--help"], capsys)
    assert code == 0 and "SpecForge" in out and "--rank" in out
    code, out, _ = cli(["torchrun", "--help"], capsys)
    assert code == 0 and "tpprobe torchrun --nproc-per-node 4 probe" in out


def test_layers_table_speaks_the_reports_vocabulary():
    res = CliRunner().invoke(app, ["layers", "--ids", "-1,2,30", "--num-layers", "61"], terminal_width=250)
    assert res.exit_code == 0, res.output
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:5]]
            for ln in res.output.splitlines() if ln.startswith("│") and ln.split("│")[1].strip()}
    # id -> SGLang's layers_to_capture, tpprobe's capture point, aux slot: id 2 is layer 2's output
    assert rows["-1"] == ["0", "embed.out", "0"] and rows["2"] == ["3", "layer.2.out", "1"]
    assert rows["30"] == ["31", "layer.30.out", "2"]
    assert "layer 2's output" in res.output


# ---- a rank's error with --debug; failed runs leave no folder ----------------------------------
def test_debug_shows_the_factorys_traceback_and_no_empty_run_folder(ranks_env, capfd):
    code, out, err = cli(["probe", "--nproc", "1", "--timeout", "20", "--model",
                          "tests.zoo.disagree:raises", "--debug"], capfd)
    assert code == 2, err
    assert "Traceback (most recent call last)" in err
    assert re.search(r'File ".*disagree.py", line \d+, in raises', err), err
    assert "tpprobe: error: --model tests.zoo.disagree:raises: the factory raised RuntimeError" in err
    runs = ranks_env / "tpprobe-runs"
    assert runs.is_dir() and list(runs.iterdir()) == [], "the failed run's folder is removed again"


# ---- --quiet, file locations, build time, the audit's wording ----------------------------------
def test_quiet_prints_the_verdict_and_says_where_files_went(ranks_env, capfd):
    code, out, err = cli(["probe", "--inject", "nan@1", "--exchange", "fingerprint", "--out", "r", "--quiet",
                          "--html", "h/r.html", "--markdown", "r.md"], capfd)
    assert code == 1, err
    lines = [" ".join(ln.split()) for ln in out.strip().splitlines()]
    rep = json.loads((ranks_env / "r" / "report.json").read_text())
    # the NaN reaches reduces whose sketches cannot sum it: counted unchecked and said, beside the root
    assert [(f["kind"], f["where"]) for f in rep["findings"]] == [("non-finite", "layer.3.out"),
                                                                  ("coverage", "collective audit")]
    assert " ".join(lines).startswith("FAILURE non-finite at layer.3.out (rank 1)")
    assert (ranks_env / "h" / "r.html").is_file() and (ranks_env / "r.md").is_file()
    # the full console names both files, and shows the model build time
    code, out, err = cli(["report", "r", "--html", "r2.html", "--markdown", "r2.md"], capfd)
    flat = " ".join(out.split())
    assert code == 1 and "HTML report: r2.html" in flat and "Markdown summary: r2.md" in flat
    assert rep["timings"]["build_s"] > 0 and "time when captured: model build" in flat
    # a sketch proves "complete within rounding", never "exactly the sum"
    assert rep["allreduce"]["method"] == "sketch"
    assert f"{rep['allreduce']['complete']} complete within rounding" in flat and "not bit-exact" in flat
    assert "exactly the sum" not in flat
    # the HTML: the slot table comes after the points table here, first on a slot fault
    from tpprobe.probe.report import render_html
    html = render_html(rep)
    assert html.index('id="verdict"') < html.index('id="points"') < html.index('id="slots"')
    slot_fault = {"kind": "capture-offset", "where": "aux slots [1, 2]", "ranks": [0, 1], "severity": "failure",
                  "line": "FAILURE capture-offset at aux slots [1, 2] (all ranks): one layer early", "detail": ""}
    html = render_html(dict(rep, findings=[slot_fault]))
    assert html.index('id="verdict"') < html.index('id="slots"') < html.index('id="points"')


def test_audit_text_says_what_each_mode_proves():
    from tpprobe.report.words import audit_text
    full = audit_text({"checked": 13, "complete": 13, "noise": 0, "incomplete": 0, "method": "tensors",
                       "count_per_rank": {"0": 13, "1": 13}})
    assert "13 complete (13 exactly the sum, 0 within rounding), 0 incomplete" in full
    assert "issued per rank: rank 0: 13, rank 1: 13" in full
    sketch = audit_text({"checked": 13, "complete": 13, "noise": 13, "incomplete": 0, "method": "sketch"})
    assert "13 complete within rounding, 0 incomplete" in sketch and "not bit-exact" in sketch


# ---- liveness and timings survive into the capture folder ---------------------------------------
def test_offline_report_keeps_the_live_runs_liveness_and_timings(ranks_env, capfd):
    code, out, err = cli(["probe", "--inject", "kill-rank@1", "--timeout", "15", "--out", "k", "--quiet"], capfd)
    assert code == 1, err
    live = " ".join(out.split())
    assert "rank-timeout at forward (rank 1): rank 1 died" in live
    manifest = json.loads((ranks_env / "k" / "manifest.json").read_text())
    assert manifest["liveness"]["1"]["state"].startswith("died") and manifest["timings"]["forward_s"] > 0
    code, out, err = cli(["report", "k"], capfd)
    flat = " ".join(out.split())
    assert code == 1
    assert "FAILURE rank-timeout at forward (rank 1): rank 1 died" in flat
    assert "no capture file for this rank" not in flat and "capture-file" not in flat
    m = re.search(r"time when captured: model build ([\d.]+)s · every rank ready at ([\d.]+)s · forward ([\d.]+)s",
                  flat)
    assert m and float(m.group(3)) > 0 and float(m.group(2)) >= float(m.group(1)), flat


# ---- under torchrun: a finding is a finding, a bad setting is said once --------------------------
def test_tpprobe_torchrun_ends_a_finding_without_childfailederror(ranks_env, capfd):
    code, out, err = cli(["torchrun", "--nproc-per-node", "2", "probe", "--inject", "nan@1", "--out", "t",
                          "--quiet"], capfd)
    assert code == 1
    assert "FAILURE non-finite at layer.3.out (rank 1)" in " ".join(out.split())
    assert "ChildFailedError" not in out + err and "Traceback" not in out + err, err
    code, out, err = cli(["torchrun", "--nproc-per-node", "2", "probe", "--backend", "nccl"], capfd)
    assert code == 2 and "ChildFailedError" not in err
    assert one_error_line(err).endswith("--backend nccl needs a CUDA device on every rank; use --backend gloo on CPU")


def test_config_sets_the_dtype_unless_dtype_is_given(tmp_path, monkeypatch, capsys):
    """--config's torch_dtype is the probe's dtype (the ranks are started with it); --dtype wins."""
    import tpprobe.probe.launch
    started = []
    monkeypatch.setattr(tpprobe.probe.launch, "launch_local", lambda n, argv, **kw: started.append(argv) or 0)
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    base = ["probe", "--engine", "sglang", "--config", str(cfg), "--out", "r"]
    for extra, want in (([], "bfloat16"), (["--dtype", "float16"], "float16")):
        assert cli(base + extra, capsys)[0] == 0
        argv = started[-1]
        assert argv[argv.index("--dtype") + 1] == want
    cfg.write_text(json.dumps({"model_type": "llama", "dtype": "float16"}))      # newer transformers' key
    assert cli(base, capsys)[0] == 0 and started[-1][started[-1].index("--dtype") + 1] == "float16"
    assert cli(["probe", "--out", "r2"], capsys)[0] == 0 and started[-1][started[-1].index("--dtype") + 1] == "float32"


def test_a_capture_over_max_bytes_is_refused_before_the_forward(ranks_env, capfd):
    code, out, err = cli(["probe", "--nproc", "1", "--max-bytes", "1000", "--out", "big"], capfd)
    assert code == 2
    line = one_error_line(err)
    assert re.search(r"this probe would write about [\d.]+ MB per rank, over --max-bytes 1e\+03: use --exchange "
                     r"fingerprint", line), line
    assert not (ranks_env / "big").exists(), "nothing was written: the folder it made is gone"
