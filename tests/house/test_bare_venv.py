"""The README's main command on a bare venv: only what `pip install -e .` declares, nothing the
test venv adds (its extras pull numpy through matplotlib, which hid a missing dependency).

The module fixture runs the README's set-up line itself (taken from the README, with its venv at
.venv-bare in the checkout instead of .venv): a fresh venv, `pip install torch==2.13.0`, `pip
install -e .`; then the main job, `tpprobe probe`, and the README's cheap commands run there, in a
scratch folder, each in a fresh bash with only that venv on PATH. A dependency tpprobe uses but
does not declare fails here. TPPROBE_BARE_VENV names another venv to use instead (built the same way)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BARE = Path(os.environ.get("TPPROBE_BARE_VENV") or ROOT / ".venv-bare")
# what the test venv has and a user's bare install must not need
TEST_ONLY = ("matplotlib", "pytest", "hypothesis", "sglang", "transformers", "pillow")


def setup_line() -> str:
    """The README's one set-up line (its first bash block)."""
    block = re.search(r"## Set up.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("python3 -m venv .venv && "), lines
    return lines[0]


def _bash(cmd: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": f"{BARE}/bin:/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "TERM": "dumb", "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": str(BARE)}
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """(the set-up line's main-job result, a runner of more commands in the bare venv)."""
    line = setup_line()
    install, main = line.rsplit(" && ", 1)
    assert main == "tpprobe probe", line
    install = install.replace(".venv", str(BARE))
    cp = _bash(f"({install}) >/dev/null", ROOT)       # idempotent: a venv already there is reused
    assert cp.returncode == 0, cp.stderr[-3000:]
    work = tmp_path_factory.mktemp("bare")
    return _bash(main, work), lambda cmd: _bash(cmd, work, timeout=300), work


def test_the_bare_venv_holds_only_what_tpprobe_declares(bare):
    cp = _bash(f"{BARE}/bin/python -m pip list --format=json", ROOT)
    names = {p["name"].lower() for p in json.loads(cp.stdout)}
    assert "tpprobe" in names and "numpy" in names      # numpy: declared (safetensors' torch API needs it)
    assert [n for n in TEST_ONLY if n in names] == []


def test_the_readmes_main_job_is_healthy_on_a_bare_venv(bare):
    cp, _, work = bare
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert "HEALTHY: every capture point agrees across ranks" in cp.stdout
    assert "Traceback" not in cp.stderr
    runs = list((work / "tpprobe-runs").iterdir())
    rep = json.loads((runs[0] / "report.json").read_text())
    assert [f for f in rep["findings"] if f["severity"] != "info"] == []
    assert rep["coverage"]["embed"] and rep["coverage"]["layers_found"] == rep["settings"]["num_layers"]


@pytest.mark.parametrize("cmd, code, says", [
    ("tpprobe --version", 0, "tpprobe 0.1.0"),
    ("tpprobe probe --exchange fingerprint --quiet", 0, "HEALTHY"),
    ("tpprobe probe --inject skip-allreduce@2 --quiet", 1, "FAILURE partial-allreduce at layer 2"),
    ("tpprobe probe --quiet --html r.html --markdown r.md && test -s r.html && test -s r.md", 0, "HEALTHY"),
    ("tpprobe layers --ids -1,2,30 --num-layers 61", 0, "layer.30.out"),
    ("tpprobe report \"$(ls -d tpprobe-runs/* | head -1)\" --quiet", 0, "HEALTHY"),
])
def test_the_readmes_cheap_commands_run_on_a_bare_venv(bare, cmd, code, says):
    _, run, _ = bare
    cp = run(cmd)
    assert cp.returncode == code, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert says in cp.stdout
    assert "Traceback" not in cp.stderr
