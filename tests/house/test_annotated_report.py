"""docs/report.md's annotated report is a real run's output: scripts/annotated_report.py
runs the command and annotates it; the page's block must be exactly that."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import annotated_report as ar  # noqa: E402


def test_the_annotated_report_is_a_real_runs_output():
    got = ar.block(ar.annotate(ar.run()))
    assert ar.page_block(ar.PAGE.read_text()) == got, "run: python scripts/annotated_report.py --write"
    assert "12 complete (12 exactly the sum, 0 within rounding)" in got   # fp32 sums at tp 2 are bit-exact
    assert all(f"← {note}" in got for _, note in ar.NOTES)
