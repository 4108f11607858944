"""Where a report goes: report.json under --out, the terminal (or --json on stdout), --html, --markdown.

One render, many sinks: every sink reads the same report dict (report/model.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .model import write_json


def emit(report: dict, out: Optional[Path], opts) -> None:
    if out is not None:
        write_json(report, Path(out) / "report.json")
    if getattr(opts, "json_out", False):
        sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    elif not getattr(opts, "quiet", False):
        from .terminal import console, render
        render(report, console())
    if getattr(opts, "html", None):
        from .html import write_html
        write_html(report, Path(opts.html), capture_dir=out)
    if getattr(opts, "markdown", None):
        from .markdown import write_markdown
        write_markdown(report, Path(opts.markdown))
