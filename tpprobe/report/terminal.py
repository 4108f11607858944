"""The terminal renderer: a Report's sections drawn with rich (rank 0 only).

`draw(report, console)` draws every section meant for the terminal, generically: a Rule, Text lines,
Tables, KeyValue tables. It reads report.model and labels' styles only and computes nothing about the
run; `terminal_console()` is the terminal's (report/emit.py `console()` ends the progress display first).
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable
from rich.text import Text as RichText

from .labels import LEVEL_STYLE, style_of
from .model import KeyValue, Report, Rule, Table, Text

__all__ = ["LEVEL_STYLE", "draw", "error_line", "quiet_lines", "terminal_console"]


def terminal_console(stderr: bool = False) -> Console:
    # rich follows the terminal's capabilities and NO_COLOR by itself
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def error_line(msg: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(RichText(f"tpprobe: error: {msg}", style="bold red"))


def _text(c) -> RichText:
    if isinstance(c, str):          # a plain cell: its text as it is (never read as markup)
        return RichText(c)
    return RichText(c.text, style=style_of(c.level, c.style))


def _table(s: Table) -> RichTable:
    t = RichTable(title=None if s.title is None else escape(s.title),
                  caption=None if s.caption is None else escape(s.caption), **s.terminal)
    for c in s.columns:
        t.add_column(c.name, justify=c.justify, no_wrap=c.no_wrap)
    for row in s.rows:
        t.add_row(*[_text(c) for c in row])
    return t


def _kv(s: KeyValue) -> RichTable:
    t = RichTable(title=None if s.title is None else escape(s.title), show_header=False)
    t.add_column("")
    t.add_column("")
    for k, v in s.items:
        t.add_row(RichText(k), _text(v))
    return t


def draw(report: Report, con: Console) -> None:
    """Every terminal section of `report`, in order."""
    for s in report.sections:
        if "terminal" not in s.media:
            continue
        if isinstance(s, Rule):
            con.rule(f"[bold]{escape(s.bold)}[/]{escape(s.rest)}")
        elif isinstance(s, Text):
            line = RichText.assemble(*[_text(c) for c in s.cells()]) if s.parts else _text(s.cells()[0])
            if s.soft_wrap is None:
                con.print(line)
            else:
                con.print(line, soft_wrap=s.soft_wrap)
        elif isinstance(s, Table):
            con.print(_table(s))
        elif isinstance(s, KeyValue):
            con.print(_kv(s))


def quiet_lines(report: Report, con: Console) -> None:
    """--quiet: the verdict lines only (a failure is never silent)."""
    for v in report.verdict:
        con.print(RichText(v.text, style="bold red" if report.exit_code else "green"))

