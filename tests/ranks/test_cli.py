"""The command line in every way a user starts it: typer's CliRunner in-process, the `tpprobe`
console script, `python -m tpprobe`, and torchrun; plus `tpprobe layers` and the examples/ model."""
import json
import os
import shutil
import subprocess
import sys

from typer.testing import CliRunner

from tests.helpers.ranks import ROOT, failures, probe, run_cli
from tpprobe.cli import app


def test_cli_runner_probe_prints_the_report_and_exits_0(tmp_path):
    res = CliRunner().invoke(app, ["probe", "--nproc", "2", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["findings"] == [] and rep["settings"]["world_size"] == 2


def test_the_short_dtype_names_probe_as_their_long_ones(tmp_path):
    # --help offers bf16 / fp16 / fp32 beside bfloat16 / float16 / float32: the run, its report and its
    # manifest carry the one long name
    from tpprobe.probe.prepare import options_from_cli
    for short, long in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        assert options_from_cli(dtype=short).dtype == long
    res = CliRunner().invoke(app, ["probe", "--dtype", "bf16", "--out", str(tmp_path / "r"), "--quiet"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["findings"] == [] and rep["settings"]["dtype"] == "bfloat16"
    assert rep["coverage"]["layers_ran"] == rep["coverage"]["layers_found"] == 6 and rep["coverage"]["embed"]
    assert rep["allreduce"]["checked"] == 13 and rep["allreduce"]["unchecked"] == 0
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["settings"]["dtype"] == "bfloat16"


def test_console_script_exits_1_on_a_fault(tmp_path):
    exe = shutil.which("tpprobe", path=os.path.dirname(sys.executable))
    assert exe, "the tpprobe console script is installed next to the interpreter"
    cp = subprocess.run([exe, "probe", "--out", str(tmp_path / "r"), "--inject", "skip-embed-allreduce"],
                        capture_output=True, text=True, timeout=180)
    assert cp.returncode == 1
    assert "partial-allreduce at embedding" in " ".join(cp.stdout.split())


def test_torchrun_runs_the_probe_on_every_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "tpprobe", "probe", "--layers", "-1,1,3", "--out", str(tmp_path / "r"), "--quiet"],
                        capture_output=True, text=True, timeout=180, env=env)
    assert cp.returncode == 0, cp.stderr[-2000:]
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["findings"] == [] and rep["settings"]["layer_ids"] == [-1, 1, 3]


def test_torchrun_exits_nonzero_when_a_fault_is_found(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "tpprobe", "probe", "--inject", "skip-allreduce@1", "--out", str(tmp_path / "r"),
                         "--quiet"], capture_output=True, text=True, timeout=180, env=env)
    assert cp.returncode != 0
    [f] = failures(json.loads((tmp_path / "r" / "report.json").read_text()))
    assert f["kind"] == "partial-allreduce"


def test_default_out_is_a_fresh_folder_under_the_working_directory(tmp_path):
    cp = run_cli(["probe", "--quiet"], cwd=tmp_path, timeout=180)
    assert cp.returncode == 0, cp.stderr
    [run] = list((tmp_path / "tpprobe-runs").iterdir())
    assert (run / "report.json").exists() and (run / "manifest.json").exists()


def test_layers_explains_deepseek_ids_without_running_a_model():
    cp = run_cli(["layers", "--arch", "deepseek_v2", "--ids", "-1,2,30", "--num-layers", "61"])
    text = " ".join(cp.stdout.split())
    # the table shows a crash (id -1 is not the embedding for DeepSeek): exit 1
    assert cp.returncode == 1 and "HF hidden_states[2]" in text and "crash" in text.lower()


def test_a_users_own_model_from_examples_is_probed_healthy(tmp_path):
    rc, rep, cp = probe(tmp_path / "r", "--model", "examples.my_model:build", "--layers", "0,1")
    assert rc == 0, cp.stderr[-2000:]
    assert rep["findings"] == []
    assert [p["name"] for p in rep["points"]] == ["embed.local", "embed.out", "layer.0.out", "layer.1.out"]
    assert rep["allreduce"]["checked"] == 3 and rep["allreduce"]["incomplete"] == 0


def test_the_example_factory_builds_and_runs_on_one_rank():
    from tests.helpers.ranks import spawn
    assert spawn(_one, 1)[0] == (8, 32)


def _one(rank, world):
    import torch
    from examples.my_model import build
    from tpprobe import RankContext
    t = build(RankContext(rank, world, rank, torch.device("cpu"), "gloo"))
    return tuple(t.forward().shape)
