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
    """report.json, the files asked for, then the terminal: the report (or --json), and where each
    file went. --quiet prints the verdict lines only (a failure is never silent)."""
    if out is not None:
        write_json(report, Path(out) / "report.json")
    written = []
    if getattr(opts, "html", None):
        from .html import write_html
        write_html(report, Path(opts.html), capture_dir=out)
        written.append(("HTML report", opts.html))
    if getattr(opts, "markdown", None):
        from .markdown import write_markdown
        write_markdown(report, Path(opts.markdown))
        written.append(("Markdown summary", opts.markdown))
    if getattr(opts, "json_out", False):
        sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
        for what, path in written:      # stdout stays pure JSON
            print(f"{what}: {path}", file=sys.stderr)
        return
    from rich.text import Text

    from .labels import verdict_lines
    from .terminal import console, render
    con = console()
    if getattr(opts, "quiet", False):
        for line in verdict_lines(report):
            con.print(Text(line, style="bold red" if report["exit_code"] else "green"))
        return
    render(report, con)
    for what, path in written:
        con.print(Text(f"{what}: {path}", style="dim"))
