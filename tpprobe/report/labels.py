"""The words every renderer uses for a cell and for the verdict (terminal, HTML, Markdown).

Renderers import this module, never each other.
"""
from __future__ import annotations

from typing import Optional

HEALTHY_LINE = "HEALTHY: every capture point agrees across ranks and every all-reduce is complete"


def verdict_lines(report: dict) -> list[str]:
    lines = [f["line"] for f in report["findings"]]
    return lines or [HEALTHY_LINE]


def verdict_items(report: dict) -> list[dict]:
    fs = report.get("findings") or []
    if fs:
        return fs
    return [{"severity": "ok", "line": HEALTHY_LINE}]


def cell_label(s: Optional[dict]) -> str:
    """The text of one capture point × rank cell (terminal, HTML and Markdown use the same words)."""
    if not s:
        return "—"
    lv = s.get("level", "?")
    if lv in ("reference", "bitwise", "share"):
        label = {"reference": "ref", "bitwise": "bitwise", "share": "own share"}[lv]
    elif lv == "shape":
        label = f"shape {s.get('shape')}"
    elif s.get("max_abs") is None:      # judged on fingerprints: the norm-wise relative difference
        label = f"{lv} ~{s.get('rel_norm', 0):.2g} rel"
    else:
        label = f"{lv} {s['max_abs']:.2g}"
    if s.get("nan") or s.get("inf"):
        label += f" nan={s.get('nan')} inf={s.get('inf')}"
    return label
