"""A README section that a script generates, between two marker lines: read it, or write it anew.
Used by scripts/annotated_report.py and scripts/knobs_table.py (their tests compare the README's
section with what the script makes)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(text: str, begin: str, end: str) -> str:
    """What stands between the `begin` and `end` lines ("" when the markers are missing)."""
    m = re.search(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), text, re.S)
    return m.group(1) if m else ""


def write(begin: str, end: str, body: str, path: Path = README) -> None:
    text = path.read_text()
    assert begin in text and end in text, f"{path.name} has no markers {begin!r} … {end!r}"
    path.write_text(text.replace(f"{begin}\n{section(text, begin, end)}\n{end}", f"{begin}\n{body}\n{end}"))
