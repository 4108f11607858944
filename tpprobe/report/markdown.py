"""`--markdown PATH`: a compact summary to paste into a GitHub issue (verdict, table, environment).

Always under 60 lines: the verdict lines come first, the table keeps every capture point that is
not bitwise on every rank plus as many of the others as fit, and the rest is one line each.
"""
from __future__ import annotations

from pathlib import Path

from .envinfo import env_lines
from .labels import LEVEL_BOLD, cell_label, coverage_text, verdict_items

MAX_LINES = 59
ICON = {"failure": "🔴", "warning": "🟡", "info": "🔵", "ok": "🟢"}


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _cell(s) -> str:
    txt = _md(cell_label(s))
    mark = "**" if (s or {}).get("level") in LEVEL_BOLD else ""
    return f"{mark}{txt}{mark}"


def render_markdown(report: dict) -> str:
    st = report.get("settings") or {}
    world = int(st.get("world_size") or 1)
    head = [f"### tpprobe rank-diff: {st.get('model')} · tp={world} · {st.get('backend')} · {st.get('dtype')} · "
            f"ids {st.get('layer_ids')}", ""]
    verdict = ["**Verdict**", ""]
    items = verdict_items(report)
    for f in items[:8]:
        verdict.append(f"- {ICON.get(f.get('severity'), '')} `{_md(f['line'])}`")
    if len(items) > 8:
        verdict.append(f"- … {len(items) - 8} more findings in report.json")
    verdict.append("")
    cov = coverage_text(report)
    if cov:
        verdict += [f"Coverage: {_md(cov)}.", ""]
    from .labels import audit_text, missing_allreduces, slot_values_differ
    ar = report.get("allreduce") or {}
    tail = []
    if ar:
        tail.append(f"All-reduce audit: {audit_text(ar, missing_allreduces(report))}.")
    slots = report.get("slots") or []
    if slots:
        bad = [s for s in slots if not s.get("ok")]
        tail.append(f"Aux slots: {len(slots) - len(bad)}/{len(slots)} hold the expected layer"
                    + ("; " + "; ".join(f"slot {s['slot']} holds {s['matched']} (expected {s['expected']})"
                                        for s in bad[:3])
                       if bad else "")
                    + "".join(f"; slot {s['slot']}'s values differ on ranks {d}"
                              for s in slots for d in [slot_values_differ(report, s)] if d) + ".")
    tail += ["", "<details><summary>Environment</summary>", ""]
    tail += [f"- {_md(l)}" for l in env_lines(report)]
    env = report.get("environment") or {}
    if env.get("platform"):
        tail.append(f"- {_md(env['platform'])}")
    tail += [f"- settings: tokens={st.get('tokens')} hidden={st.get('hidden')} layers={st.get('num_layers')} "
             f"seed={st.get('seed')} exchange={st.get('exchange')} inject={','.join(st.get('inject') or []) or '-'}",
             "", "</details>", "",
             f"<sub>{_md(report.get('tool', 'tpprobe'))} · exit code {report.get('exit_code', '?')}</sub>"]

    points = report.get("points") or []
    missing = set(report.get("ranks_missing") or [])
    budget = MAX_LINES - len(head) - len(verdict) - len(tail) - 5
    interesting = [p for p in points if p.get("level") not in ("bitwise", "share", "exact")]
    keep = set(id(p) for p in interesting[:max(budget, 0)])
    for p in points:
        if len(keep) >= budget:
            break
        keep.add(id(p))
    table = ["| capture point | " + " | ".join(f"rank {r}" for r in range(world)) + " |",
             "|---|" + "---|" * world]
    for p in points:
        if id(p) not in keep:
            continue
        row = []
        for r in range(world):
            s = (p.get("per_rank") or {}).get(str(r))
            row.append(_cell(s) if s else ("missing" if r in missing else "—"))
        table.append(f"| `{_md(p['name'])}` | " + " | ".join(row) + " |")
    dropped = len(points) - len(keep)
    if dropped > 0:
        rest = [p for p in points if id(p) not in keep]
        quiet = all(p.get("level") in ("bitwise", "share", "exact") for p in rest)
        table += ["", f"_{dropped} more capture points{', all bitwise or own shares' if quiet else ''}: "
                      f"see the HTML report or report.json_"]
    table.append("")
    lines = head + verdict + table + tail
    return "\n".join(lines[:MAX_LINES]) + "\n"


def write_markdown(report: dict, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes
    from ..formats.capture_dir import make_file_folder
    path = Path(path)
    make_file_folder(path, "--markdown")
    atomic_write_bytes(path, render_markdown(report).encode("utf-8"))


# ---- any Report: its sections, generically -----------------------------------------------------------
def _section_cell(c) -> str:
    if isinstance(c, str):
        return _md(c)
    txt = _md(c.text)
    return f"**{txt}**" if c.level in LEVEL_BOLD and txt.strip() else txt


def _section_md(s) -> list[str]:
    from .model import KeyValue, Table, Text
    if isinstance(s, Text):
        if s.heading:
            return [f"**{_md(s.plain.strip())}**", ""]
        return ["".join(_section_cell(c) for c in s.cells()).strip() + "  "]
    if isinstance(s, Table):
        out = [f"**{_md(s.title)}**", ""] if s.title else []
        out += ["| " + " | ".join(_md(c.name) or " " for c in s.columns) + " |", "|---" * len(s.columns) + "|"]
        out += ["| " + " | ".join(_section_cell(c) for c in row) + " |" for row in s.rows]
        out += (["", f"_{_md(s.caption)}_"] if s.caption else []) + [""]
        return out
    if isinstance(s, KeyValue):
        return ([f"**{_md(s.title)}**", ""] if s.title else []) + [f"- {_md(k)}: {_section_cell(v)}"
                                                                  for k, v in s.items] + [""]
    return []


def render_report_markdown(report) -> str:
    """A Report (report/model.py) as Markdown for an issue: title, verdict lines, every Markdown section,
    the environment folded."""
    out = [f"### {_md(report.title)}", "", "**Verdict**", ""]
    out += [f"- {ICON.get(c.level, '')} `{_md(c.text)}`".replace("-  `", "- `") for c in report.verdict] + [""]
    for s in report.sections:
        if "markdown" in s.media:
            out += _section_md(s)
    env = env_lines({"environment": report.environment, "settings": report.settings}) if report.environment else []
    if env:
        out += ["", "<details><summary>Environment</summary>", "", *[f"- {_md(x)}" for x in env], "", "</details>"]
    out += ["", f"<sub>{_md(report.tool)} · exit code {report.exit_code}</sub>"]
    return "\n".join(out) + "\n"


def write_report_markdown(report, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes, make_file_folder
    path = Path(path)
    make_file_folder(path, "--markdown")
    atomic_write_bytes(path, render_report_markdown(report).encode("utf-8"))
