"""The report model: one `Report` (its JSON document, verdict lines and typed sections) every command fills.

Every command (probe, report, invariance, diff, layers, the dumper's check and diff, accept) builds a
`Report`: `document` is what report.json and `--json` hold (each command's own schema, unchanged), the
verdict lines and the `sections` (`Rule`, `Text`, `Table`, `KeyValue`; for the files `Block`, `Fold`,
`Callout`, `Bullets`, `Heatmap`, `Heatmaps`) are what the terminal, HTML and Markdown draw, generically
(report/emit.py is the one sink). A section builder (the command's own
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
    has no level, a `style` (dim, bold; `code` and `italic` in HTML and Markdown); `hint` is the HTML
    cell's hover text (None: none)."""
    text: str
    level: Optional[str] = None
    style: Optional[str] = None
    hint: Optional[str] = None


@dataclass
class Column:
    name: str
    justify: str = "left"
    no_wrap: bool = False


@dataclass
class Row:
    """A table row with a class of its own in HTML (a row that stands out: a collective never issued)."""
    cells: list
    css: str = ""


@dataclass
class Table:
    """Rows of cells (a plain str is a cell without a level). `terminal`: rich Table options
    (title_justify, show_lines, pad_edge, header_style) that shape the terminal's drawing only.
    HTML: `css` names the table's class (None: a plain table under its title); `bare`: no thead/tbody;
    `row_headers`: each row's first cell is a header cell."""
    title: Optional[str]
    columns: list[Column]
    rows: list[Union[list[Union[Cell, str]], Row]]
    caption: Optional[str] = None
    terminal: dict = field(default_factory=dict)
    media: tuple = EVERYWHERE
    css: Optional[str] = None
    bare: bool = False
    row_headers: bool = False


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
    # HTML: the element (h1, h3, p, div, footer) with its class and id; Markdown: a heading (h1-h3), a
    # paragraph (p: a blank line after it), a line (div), <sub>; None: a monospaced line of spans
    tag: Optional[str] = None
    css: str = ""
    anchor: str = ""

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
    css: Optional[str] = None      # as Table's
    bare: bool = False


@dataclass
class Rule:
    """The terminal's title rule: `bold` then `rest` (the HTML and Markdown use the report's title)."""
    bold: str
    rest: str = ""
    media: tuple = TERMINAL


@dataclass
class Block:
    """Sections kept together under one heading: HTML <section id=anchor><h2>title</h2>…</section> (or
    `tag` div with `css`; tag "": the body alone). A block with an empty body draws nothing."""
    anchor: str = ""
    title: Optional[str] = None
    body: list = field(default_factory=list)
    tag: str = "section"
    css: str = ""
    media: tuple = FILES


@dataclass
class Fold:
    """Sections folded under a one-line summary (HTML and Markdown <details>)."""
    summary: str
    body: list = field(default_factory=list)
    media: tuple = FILES


@dataclass
class Callout:
    """A boxed line with its level (a verdict line), an optional note under it and bullets."""
    text: str
    level: Optional[str] = None
    note: Optional[str] = None
    bullets: list = field(default_factory=list)
    media: tuple = FILES


@dataclass
class Bullets:
    """A list: each item a Cell (its level's icon in Markdown; style `code` set as code)."""
    items: list
    media: tuple = FILES


@dataclass
class Heatmap:
    """Values over rows × columns (None: not compared), with a level per cell (`bitwise` where equal,
    `n/a` where not compared, None: a value on the shared log scale up to `vmax`), drawn as an image.
    `rows` are the row labels, `columns` the number of columns and `xlabel` what they are; `chart` is
    the image's own title, `title` and `note` its heading."""
    title: str
    rows: list[str]
    columns: int
    values: list[list[Optional[float]]]
    levels: list[list[Optional[str]]]
    vmax: float
    xlabel: str = ""
    chart: str = ""
    note: str = ""
    media: tuple = ("html",)


@dataclass
class Heatmaps:
    """A grid of heatmaps; `folded` ones under `fold` (a summary line), `empty`: the line when the grid
    has none. Where the HTML cannot draw images (no matplotlib) it says so instead."""
    maps: list[Heatmap]
    folded: list[Heatmap] = field(default_factory=list)
    fold: str = ""
    empty: str = ""
    media: tuple = ("html",)


Section = Union[Rule, Text, Table, KeyValue, Block, Fold, Callout, Bullets, Heatmap, Heatmaps]


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
    page        the sections draw the whole HTML page and Markdown summary (their own head, verdict and
                environment: the probe's); `max_lines` caps the Markdown (an issue's summary)
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
    page: bool = False
    max_lines: Optional[int] = None

    def environment_lines(self) -> list[str]:
        """The environment in a few lines (GPUs, versions, topology), for the renderers to lay out."""
        if not self.environment:
            return []
        from .envinfo import env_lines
        return env_lines({"environment": self.environment, "settings": self.settings})


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
