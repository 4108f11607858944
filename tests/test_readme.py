"""The README's commands run as written, each in a fresh bash with only the venv activated
(`. .venv/bin/activate`, as the README says), in a scratch folder that holds the checkout's files.

scripts/readme_commands.py finds and classifies every command; a command it cannot classify fails
here. The default tier runs the cheap ones; the sweep tier (`-m sweep`) runs the rest. The fault
table's rows are checked word for word by tests/test_faults.py (from the runs it makes anyway).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_commands as rc  # noqa: E402

VENV = Path(sys.executable).parent.parent      # the venv running the tests: the README's .venv
EXPECTED_EXIT = [(r"--inject skip-allreduce@2", 1),
                 (r"^tpprobe diff tpprobe-runs/rows_0-5000/data_0\.ckpt tpprobe-runs/serve$", 1),
                 (r"^tpprobe layers --arch deepseek_v2 --ids -1,2,30", 1),   # its table shows a crash (issue 15)
                 (r"^tpprobe layers --draft-config examples/eagle3", 1),     # the example's contract differs (F19)
                 (r"^python -m examples\.accept_toy_draft$", 1),             # the broken capture costs accept length
                 (r"^tpprobe invariance --tp 1,2,4 --batch 1,3,8$", 1)]       # the default reduce is not TP-invariant
EXPECTED_OUT = {  # what the README says the command prints (a fragment, whitespace-normalised)
    "tpprobe probe": "HEALTHY: every capture point agrees across ranks",
    "tpprobe probe --inject skip-allreduce@2": "FAILURE partial-allreduce at layer 2 (layers.2.self_attn.o_proj) (all "
                                               "ranks)",
    "tpprobe diff tpprobe-runs/rows_0-5000/data_0.ckpt tpprobe-runs/serve": "MISMATCH: slots are shifted by 1 position",
    "tpprobe --version": "tpprobe 0.1.0",
    "tpprobe invariance --tp 1,2,4 --batch 1,3,8": "bitwise equality breaks at the collective of "
                                                   "layers.0.self_attn.o_proj",
    "PYTHONPATH=. tpprobe probe --model examples.my_model:build --layers 0,1": "HEALTHY",
    **{f"PYTHONPATH=. tpprobe probe --model examples.{m} --nproc {n}": "HEALTHY" for m, n in (
        ("dtensor_llama:build_sequence_parallel", 4), ("megatron_gpt:build_sequence_parallel", 4))},
    "tpprobe layers --ids -1,2,30 --num-layers 61": "layer.30.out",
    "tpprobe layers --draft-config examples/eagle3/draft_config.json "
    "--target-config examples/eagle3/target_config.json":
        "FAILURE id-contract (capture-offset at aux slot 0)",
}


def _installed_here() -> bool:
    """Does the venv's own tpprobe come from this checkout (as after the README's `pip install -e .`)?"""
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", "import tpprobe; print(tpprobe.__file__)"],
                         capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"}).stdout
    return out.strip().startswith(str(ROOT / "tpprobe"))


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """run(cmd, cwd) -> CompletedProcess: a fresh bash, nothing inherited but HOME and a plain PATH."""
    assert (VENV / "bin" / "activate").is_file(), f"no venv at {VENV}"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "LANG": "C.UTF-8", "TERM": "dumb"}
    if not _installed_here():     # a worktree whose venv installed another checkout: point it here
        env["PYTHONPATH"] = str(ROOT)

    def folder(name: str) -> Path:
        d = tmp_path_factory.mktemp(name)
        for entry in ROOT.iterdir():          # the checkout's files, as in a clone; outputs stay here
            if entry.name not in (".git", "tpprobe-runs", ".venv") and not entry.name.startswith("."):
                (d / entry.name).symlink_to(entry)
        return d

    def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "--noprofile", "--norc", "-c", f". {VENV}/bin/activate && {cmd}"],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    run.folder = folder
    return run


def _check(c: rc.Command, p: subprocess.CompletedProcess) -> None:
    want = next((code for pat, code in EXPECTED_EXIT if re.search(pat, c.text)), 0)
    assert p.returncode == want, \
        f"{c.text}: exit {p.returncode}, README says {want}\n{p.stdout[-1500:]}{p.stderr[-1500:]}"
    assert "Traceback" not in p.stderr and "error" not in p.stderr.lower(), (c.text, p.stderr[-1500:])
    if c.text in EXPECTED_OUT:
        assert EXPECTED_OUT[c.text] in " ".join(p.stdout.split()), (c.text, p.stdout[-1500:])


def test_every_readme_command_is_classified():
    cmds = rc.commands()
    assert [c.text for c in cmds if c.cls == "unclassified"] == []
    assert any(c.cls == "run" and c.cost == "fast" for c in cmds)


def _groups(cost: str) -> list[list[rc.Command]]:
    """Commands to run, a README block's commands together (in order, in one folder)."""
    groups: dict[str, list] = {}
    for c in rc.commands():
        if c.cls == "run" and c.cost == cost:
            groups.setdefault(c.where if c.where != "inline" else c.text, []).append(c)
    return list(groups.values())


def _params():
    """Every runnable group; the costly ones in the sweep tier."""
    return [pytest.param(g, id=g[0].text[:50], marks=[pytest.mark.sweep] if cost == "slow" else [])
            for cost in ("fast", "slow") for g in _groups(cost)]


@pytest.mark.parametrize("group", _params())
def test_readme_command_runs_as_written(group, shell):
    d = shell.folder("readme")
    for c in group:
        _check(c, shell(c.text, d))
