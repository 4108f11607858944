"""Installing tpprobe into an SGLang server's environment never changes the server's stack, and
the plugin says which SGLang it found.

The venv running these tests holds the SGLang CPU tier (sglang 0.5.23 and its pinned set): it
stands for a server's environment. `pip install --dry-run -e .` there must install tpprobe alone."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.sglang


def test_installing_tpprobe_into_a_server_env_installs_tpprobe_and_nothing_else(tmp_path):
    pytest.importorskip("sglang")
    rep = tmp_path / "report.json"
    cp = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(rep),
                         "-e", str(ROOT)], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-3000:]
    installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(rep.read_text())["install"]]
    assert [n for n, _ in installs] == ["tpprobe"], installs


def test_the_plugin_says_which_sglang_it_found_and_that_it_is_tested(tmp_path):
    pytest.importorskip("sglang")
    env = {**os.environ, "TPPROBE_CAPTURE_DIR": str(tmp_path / "cap"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cp = subprocess.run([sys.executable, "-c", "from tpprobe.engines.sglang.plugin import register; register()"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert cp.returncode == 0, cp.stderr[-3000:]
    lines = [ln for ln in cp.stderr.splitlines() if "SGLang" in ln and "found" in ln]
    assert len(lines) == 1 and lines[0].endswith("SGLang 0.5.23 found: a version tpprobe is tested with"), cp.stderr


def test_an_untested_sglang_is_named_in_one_line_and_never_stops_the_plugin(monkeypatch):
    import tpprobe.engines.sglang as sg
    monkeypatch.setattr(sg, "installed_version", lambda: "0.9.0")
    line = sg.version_line()
    assert line.startswith("SGLang 0.9.0 found: NOT a version tpprobe is tested with (0.5.23)")


def test_the_cpu_tier_pins_the_release_tpprobe_says_it_is_tested_with():
    import tpprobe.engines.sglang as sg
    script = (ROOT / "ci" / "sglang-cpu" / "install.sh").read_text()
    assert re.search(r"^SGLANG_VERSION=(\S+)$", script, re.M).group(1) == sg.SGLANG_VERSION
    assert sg.SGLANG_VERSION in sg.TESTED_VERSIONS
    assert "sglang" not in " ".join(
        re.findall(r"^\s*(\w+)\s*=\s*\[",
                   (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
                   .split("[project.scripts]")[0], re.M))
    page = (ROOT / "docs" / "sglang.md").read_text()
    assert f"SGLang {sg.SGLANG_VERSION}" in page and "'.[sglang]'" not in page
