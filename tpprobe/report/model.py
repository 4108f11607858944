"""The report model: one `Report` (its JSON document, verdict lines and typed sections) every command fills.

Every command (probe, report, invariance, diff, layers, the dumper's check and diff, accept) builds a
`Report`: `document` is what report.json and `--json` hold (each command's own schema, unchanged), the
verdict lines and the `sections` (`Rule`, `Text`, `Table`, `KeyValue`) are what the terminal, HTML and
Markdown draw, generically (report/emit.py is the one sink). A section builder (the command's own
`report.py` / `render.py`) computes every domain fact; renderers only lay sections out. Cells and lines
name a level or severity (report/labels.py `LEVELS`: the style of each, in every renderer, declared
once). `build_report` assembles the probe's document from the checks' result; `write_json` is the JSON
file sink.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .. import __version__
from ..checks.findings import exit_code

SCHEMA = "tpprobe.report/1"

EVERYWHERE = ("terminal", "html", "markdown")
TERMINAL = ("terminal",)
FILES = ("html", "markdown")


@dataclass
class Cell:
    """One piece of text with how it looks: `level` (a level or severity of labels.LEVELS) or, for what
    has no level, a terminal `style` (dim, bold); `hint` is the HTML cell's hover text."""
    text: str
    level: Optional[str] = None
    style: Optional[str] = None
    hint: str = ""


@dataclass
class Column:
    name: str
    justify: str = "left"
    no_wrap: bool = False


@dataclass
class Table:
    """Rows of cells (a plain str is a cell without a level). `terminal`: rich Table options
    (title_justify, show_lines, pad_edge, header_style) that shape the terminal's drawing only."""
    title: Optional[str]
    columns: list[Column]
    rows: list[list[Union[Cell, str]]]
    caption: Optional[str] = None
    terminal: dict = field(default_factory=dict)
    media: tuple = EVERYWHERE


@dataclass
class Text:
    """A line (or paragraph): one Cell, or several `parts` in a row. `heading`: the HTML and Markdown
    draw it as a heading; `soft_wrap` is the terminal's (None: the console's default)."""
    text: str = ""
    level: Optional[str] = None
    style: Optional[str] = None
    parts: list[Cell] = field(default_factory=list)
    heading: bool = False
    soft_wrap: Optional[bool] = None
    media: tuple = EVERYWHERE

    def cells(self) -> list[Cell]:
        return self.parts or [Cell(self.text, self.level, self.style)]

    @property
    def plain(self) -> str:
        return "".join(c.text for c in self.cells())


@dataclass
class KeyValue:
    """A two-column table of names and values (settings, environment)."""
    title: Optional[str]
    items: list[tuple[str, Union[Cell, str]]]
    media: tuple = EVERYWHERE


@dataclass
class Rule:
    """The terminal's title rule: `bold` then `rest` (the HTML and Markdown use the report's title)."""
    bold: str
    rest: str = ""
    media: tuple = TERMINAL


Section = Union[Rule, Text, Table, KeyValue]


def dump_json(document: dict) -> str:
    """The JSON text of a document as report.json and --json have always written it."""
    return json.dumps(document, indent=1, default=str)


@dataclass
class Report:
    """What one command found, ready for every sink (report/emit.py).

    schema      the command's document schema (tpprobe.report/1, tpprobe.invariance/1, ...)
    title       one line: the HTML page's and the Markdown summary's heading
    document    the JSON document (report.json, --json), unchanged per command
    verdict     the verdict lines (each a Cell with its level or severity): --quiet, the HTML box, Markdown
    sections    what the terminal, HTML and Markdown draw, in order (each names its media)
    settings, environment, findings   the document's, for every renderer alike
    to_json     how `document` is written (default `dump_json`); stdout gets it plus a newline
    """
    schema: str
    title: str
    document: Any
    verdict: list[Cell] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)
    exit_code: int = 0
    tool: str = f"tpprobe {__version__}"
    to_json: Callable[[Any], str] = dump_json
    # a document's own file writers (path) -> None, where sections alone do not say it all (the probe's
    # heatmaps and its 60-line issue summary); None: the generic renderers draw the sections
    write_html: Optional[Callable[[Path], None]] = None
    write_markdown: Optional[Callable[[Path], None]] = None


def environment() -> dict:
    from .envinfo import environment as _environment
    return _environment()


def build_report(settings: dict, result: dict, timings: dict, out: Optional[str]) -> dict:
    findings = result["findings"]
    return {"schema": SCHEMA, "tool": f"tpprobe {__version__}", "settings": settings,
            "environment": environment(), "timings": timings, "out": out,
            "points": result["points"], "allreduce": result["allreduce"], "slots": result["slots"],
            "coverage": result.get("coverage", {}),
            "ranks_missing": result.get("ranks_missing", []), "findings": findings,
            "exit_code": exit_code(findings)}


def write_json(report: dict, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes
    atomic_write_bytes(Path(path), dump_json(report).encode())
