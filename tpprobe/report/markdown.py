"""`--markdown PATH`: a Report as Markdown to paste into a GitHub issue, its sections laid out.

It reads report.model and report.labels only: each command's builder decides what the summary says (the
probe's keeps it under 60 lines: `Report.max_lines`).
"""
from __future__ import annotations

from .labels import ICON, LEVEL_BOLD
from .model import Block, Bullets, Callout, Cell, Fold, KeyValue, Report, Row, Table, Text


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _section_cell(c) -> str:
    if isinstance(c, str):
        return _md(c)
    txt = _md(c.text)
    core = txt.strip()
    if not core:
        return txt
    # the marks go around the words: CommonMark does not read `** FAILURE**` as bold
    lead, trail = txt[:len(txt) - len(txt.lstrip())], txt[len(txt.rstrip()):]
    if c.style == "code":
        return f"{lead}`{core}`{trail}"
    if c.style == "italic":
        return f"{lead}_{core}_{trail}"
    return f"{lead}**{core}**{trail}" if c.level in LEVEL_BOLD else txt


def _item(c) -> str:
    if isinstance(c, str):
        return f"- {_md(c)}"
    icon = ICON.get(c.level or "")
    return "- " + (f"{icon} " if icon else "") + _section_cell(c)


HEADINGS = {"h1": "### ", "h2": "### ", "h3": "### "}


def _text(s: Text) -> list[str]:
    if s.heading:
        return [f"**{_md(s.plain.strip())}**", ""]
    line = "".join(_section_cell(c) for c in s.cells())
    if s.tag is None:
        return [line.strip() + "  "]
    if s.tag in HEADINGS:
        return [HEADINGS[s.tag] + line, ""]
    if s.tag == "sub":
        return [f"<sub>{line}</sub>"]
    return [line, ""] if s.tag == "p" else [line]


def _section_md(s) -> list[str]:
    if isinstance(s, Text):
        return _text(s)
    if isinstance(s, Table):
        out = [f"**{_md(s.title)}**", ""] if s.title else []
        out += ["| " + " | ".join(_md(c.name) or " " for c in s.columns) + " |", "|---" * len(s.columns) + "|"]
        out += ["| " + " | ".join(_section_cell(c) for c in (r.cells if isinstance(r, Row) else r)) + " |"
                for r in s.rows]
        out += (["", f"_{_md(s.caption)}_"] if s.caption else []) + [""]
        return out
    if isinstance(s, KeyValue):
        return ([f"**{_md(s.title)}**", ""] if s.title else []) + [f"- {_md(k)}: {_section_cell(v)}"
                                                                  for k, v in s.items] + [""]
    if isinstance(s, Bullets):
        return [_item(c) for c in s.items] + [""]
    if isinstance(s, Callout):
        return [_item(Cell(s.text, s.level, "code"))]
    if isinstance(s, Block):
        out = [f"**{_md(s.title)}**", ""] if s.title and s.body else []
        return out + [x for b in s.body for x in _section_md(b)]
    if isinstance(s, Fold):
        return (["", f"<details><summary>{_md(s.summary)}</summary>", ""]
                + [x for b in s.body for x in _section_md(b)] + ["</details>", ""])
    return []


def render_report_markdown(report: Report) -> str:
    """A Report (report/model.py) as Markdown for an issue: title, verdict lines, every Markdown section,
    the environment folded. A `page` report's sections are the whole summary (at most `max_lines`)."""
    if report.page:
        lines = [x for s in report.sections if "markdown" in s.media for x in _section_md(s)]
        return "\n".join(lines[:report.max_lines]) + "\n"
    out = [f"### {_md(report.title)}", "", "**Verdict**", ""]
    out += [f"- {ICON.get(c.level, '')} `{_md(c.text)}`".replace("-  `", "- `") for c in report.verdict] + [""]
    for s in report.sections:
        if "markdown" in s.media:
            out += _section_md(s)
    env = report.environment_lines()
    if env:
        out += ["", "<details><summary>Environment</summary>", "", *[f"- {_md(x)}" for x in env], "", "</details>"]
    out += ["", f"<sub>{_md(report.tool)} · exit code {report.exit_code}</sub>"]
    return "\n".join(out) + "\n"
