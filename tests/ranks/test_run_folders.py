"""Run folders and first runs (the real CLI, real gloo ranks): default folders work anywhere;
nothing is overwritten or mixed by accident; a user's model with no `arch` is HEALTHY; --help shows
flags as flags, markup intact, defaults as written; capture files are readable like each other;
errors say what is really wrong."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from tests.helpers.ranks import probe, run_cli

MODELS = "tests.zoo.user_model"


def test_the_readmes_own_model_snippet_with_no_arch_is_healthy_with_full_coverage(tmp_path):
    code, rep, cp = probe(tmp_path / "own", "--model", f"{MODELS}:readme_snippet", "--layers", "0,1")
    assert code == 0, cp.stdout[-3000:] + cp.stderr[-2000:]
    assert [f for f in rep["findings"] if f["severity"] != "info"] == []
    assert not any(f["kind"] == "reference-mismatch" for f in rep["findings"])
    cov = rep["coverage"]
    assert cov["embed"] == "embed_tokens" and cov["layers_found"] == rep["settings"]["num_layers"] == 2
    assert rep["settings"]["arch"] == "custom"


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_out_onto_an_earlier_capture_is_refused_and_leaves_it_as_it_was(tmp_path):
    out = tmp_path / "training"
    code, _, _ = probe(out, nproc=4)
    assert code == 0
    before = _digest(out)
    code, _, cp = probe(out, "--layers", "-1,2,4", nproc=2)       # a tp-2 run into the tp-4 folder
    assert code == 2
    line = cp.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tpprobe: error: --out {out} already holds a tpprobe run (manifest.json, rank-000.json")
    assert "choose a new folder" in line
    assert _digest(out) == before          # nothing overwritten, no rank of the new run beside the old ones


def test_capture_files_are_readable_like_the_json_beside_them(tmp_path):
    old = os.umask(0o022)
    try:
        code, _, _ = probe(tmp_path / "modes")
    finally:
        os.umask(old)
    assert code == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "modes").iterdir()}
    assert modes["rank-000.safetensors"] == modes["rank-000.json"] == 0o644, modes


def test_invariance_with_its_default_folder_works_in_a_folder_without_tpprobe_runs(tmp_path):
    cp = run_cli(["invariance", "--tp", "1", "--batch", "1,3", "--quiet"], cwd=tmp_path, timeout=300)
    assert cp.returncode in (0, 1), cp.stderr[-2000:]
    assert "does not exist" not in cp.stderr
    made = list((tmp_path / "tpprobe-runs").glob("invariance-*"))
    assert len(made) == 1 and (made[0] / "report.json").is_file()


@pytest.mark.parametrize("command", ["probe", "accept", "report", "diff", "layers", "invariance", "specforge"])
def test_help_shows_flags_as_flags_keeps_its_brackets_and_writes_defaults_as_people_do(command):
    cp = run_cli([command, "--help"], timeout=120)
    assert cp.returncode == 0
    assert "<bool>" not in cp.stdout
    if command == "probe":
        text = " ".join(cp.stdout.split())
        assert "emits [tokens, hidden]" in text
        assert "[default: 2e9]" in text and "2000000000" not in text


def test_report_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    cp = run_cli(["report", str(tmp_path / "nosuch")], timeout=60)
    assert cp.returncode == 2
    assert cp.stderr.strip() == f"tpprobe: error: {tmp_path / 'nosuch'}: no such file or folder; give a tpprobe " \
                                f"capture folder (with manifest.json)"


def test_a_missing_factory_in_a_module_that_imported_names_the_factory_not_pythonpath(tmp_path):
    code, _, cp = probe(tmp_path / "x", "--model", "examples.my_model:nosuch")
    assert code == 2
    line = cp.stderr.strip().splitlines()[-1]
    assert "has no factory 'nosuch'" in line and "it defines" in line and "build" in line
    assert "PYTHONPATH" not in line


def test_with_debug_a_factory_error_shows_the_traceback_and_no_debug_hint(tmp_path):
    code, _, cp = probe(tmp_path / "x", "--model", f"{MODELS}:raises", "--debug")
    assert code == 2
    assert "Traceback" in cp.stderr
    last = cp.stderr.strip().splitlines()[-1]
    assert "the factory raised RuntimeError: the factory's own bug" in last and "--debug" not in last


def test_the_html_paints_reduces_complete_within_rounding_green_not_yellow(tmp_path):
    from tpprobe.probe.report import render_html
    code, rep, _ = probe(tmp_path / "fp", "--exchange", "fingerprint", "--dtype", "bfloat16")
    assert code == 0 and rep["allreduce"]["noise"] == rep["allreduce"]["checked"] > 0   # sketches: within rounding
    html = render_html(rep)
    audit = html[html.index('<section id="allreduce">'):]
    audit = audit[:audit.index("</section>")]
    assert 'class="noise"' not in audit and 'class="bad"' not in audit
    assert audit.count('class="ok"') >= rep["allreduce"]["checked"]
