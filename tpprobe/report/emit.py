"""Where a report goes: report.json, the terminal (or --json on stdout), --html, --markdown.

The one sink of every command: each hands it a Report (report/model.py) and the same flags, and every
file and stream is written the same way.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from .model import Report


def emit(report: Report, out: Optional[Path], opts) -> None:
    """report.json under `out` (None: the command writes none), the files asked for (opts.html,
    opts.markdown), then the terminal: the report (or --json), and where each file went. --quiet
    prints the verdict lines only (a failure is never silent)."""
    if out is not None:
        from ..formats.capture_dir import atomic_write_bytes
        atomic_write_bytes(Path(out) / "report.json", report.to_json(report.document).encode())
    written = []
    if getattr(opts, "html", None):
        write_html(report, Path(opts.html))
        written.append(("HTML report", opts.html))
    if getattr(opts, "markdown", None):
        write_markdown(report, Path(opts.markdown))
        written.append(("Markdown summary", opts.markdown))
    if getattr(opts, "json_out", False):
        sys.stdout.write(report.to_json(report.document) + "\n")
        for what, path in written:      # stdout stays pure JSON
            print(f"{what}: {path}", file=sys.stderr)
        return
    from rich.text import Text

    from .terminal import draw, quiet_lines
    con = console()
    if getattr(opts, "quiet", False):
        quiet_lines(report, con)
        return
    draw(report, con)
    for what, path in written:
        con.print(Text(f"{what}: {path}", style="dim"))


def console(stderr: bool = False):
    """The terminal's rich Console, once the progress display (rank 0) has ended."""
    from .live import stop_all
    from .terminal import terminal_console
    stop_all()
    return terminal_console(stderr)


def _write(path: Path, text: str, flag: str) -> None:
    from ..formats.capture_dir import atomic_write_bytes, make_file_folder
    make_file_folder(path, flag)
    atomic_write_bytes(path, text.encode("utf-8"))


def write_html(report: Report, path: Path) -> None:
    """The report as one self-contained HTML file (atomically)."""
    from .html import render_report_html
    _write(Path(path), render_report_html(report), "--html")


def write_markdown(report: Report, path: Path) -> None:
    """The report's Markdown summary (atomically)."""
    from .markdown import render_report_markdown
    _write(Path(path), render_report_markdown(report), "--markdown")


class Flags:
    """The sink's flags for a command that has no options object: Flags(json_out=..., html=...)."""

    def __init__(self, json_out: bool = False, html=None, markdown=None, quiet: bool = False):
        self.json_out, self.html, self.markdown, self.quiet = json_out, html, markdown, quiet
