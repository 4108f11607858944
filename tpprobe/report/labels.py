"""The words and styles every renderer uses for a level (terminal, HTML, Markdown), declared once.

Renderers import this module and report.model only, never each other; the sentences a report says about a
run are its builder's (report/words.py for the probe's).
"""
from __future__ import annotations

from typing import Optional

# Every level a cell can take and every severity a line can have, with how each renderer shows it:
# (terminal style, HTML class, Markdown bold). Declared once: every renderer and every command reads it.
LEVELS = {
    "bitwise": ("green", "ok", False), "exact": ("green", "ok", False), "reference": ("cyan", "ref", False),
    "noise": ("yellow", "noise", False), "material": ("bold red", "bad", True), "shape": ("bold red", "shape", True),
    "incomplete": ("bold red", "bad", True), "missing": ("bold red", "bad", True), "unchecked": ("dim", "dim", False),
    "share": ("dim", "dim", False), "n/a": ("dim", "dim", False),
    # severities of a finding or a verdict line
    "failure": ("bold red", "bad", True), "warning": ("yellow", "noise", False), "info": ("cyan", "ref", False),
    "ok": ("green", "ok", False),
}
# the terminal's one-symbol cell of a level, where a table is too wide for words (tpprobe invariance)
LEVEL_MARK = {"bitwise": "=", "noise": "≈", "material": "✗", "shape": "✗ shape", "missing": "✗ missing"}
LEVEL_STYLE = {k: v[0] for k, v in LEVELS.items()}
LEVEL_CLASS = {k: v[1] for k, v in LEVELS.items()}
LEVEL_BOLD = frozenset(k for k, v in LEVELS.items() if v[2])


def style_of(level: Optional[str], style: Optional[str] = None) -> str:
    """A cell's terminal style: its own, else its level's."""
    return style if style is not None else LEVEL_STYLE.get(level or "", "")


# a severity's mark in a Markdown list (an issue's summary)
ICON = {"failure": "🔴", "warning": "🟡", "info": "🔵", "ok": "🟢"}
