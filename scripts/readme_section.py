"""A doc section that a script generates, between two marker lines: read it, or write it anew.
Used by scripts/annotated_report.py, knobs_table.py and layout.py (their tests compare the page's
section with what the script makes)."""
from __future__ import annotations

import re
from pathlib import Path

def section(text: str, begin: str, end: str) -> str:
    """What stands between the `begin` and `end` lines ("" when the markers are missing or empty)."""
    m = re.search(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), text, re.S)
    return m.group(1).rstrip("\n") if m else ""


def write(begin: str, end: str, body: str, path: Path) -> None:
    text = path.read_text()
    assert begin in text and end in text, f"{path.name} has no markers {begin!r} … {end!r}"
    m = re.search(re.escape(begin) + r"\n.*?" + re.escape(end), text, re.S)
    path.write_text(text[:m.start()] + f"{begin}\n{body}\n{end}" + text[m.end():])
