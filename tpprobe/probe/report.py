"""The probe's report (`tpprobe probe`, `tpprobe report`) as the shared Report: its sections.

`probe_report(document)` turns the report dict (report/model.py `build_report`) into a Report: for the
terminal the capture point × rank table, coverage, the all-reduce audit, the aux slots, SGLang's layer plan
(computed here, never by a renderer), the verdict and the settings line; for the HTML page and the Markdown
issue summary the sections probe/page.py builds (heatmaps included). The renderers lay them out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..report.words import (audit_text, cell_label, coverage_parts, coverage_text, healthy_level,
                            missing_allreduces, slot_holds, slot_values_differ, timing_text, verdict_lines)
from ..report.model import SCHEMA, TERMINAL, Cell, Column, Report, Rule, Table, Text


def title(st: dict) -> str:
    return (f"{st.get('model')} · tp={st['world_size']} · {st.get('backend')} · {st.get('dtype')} · "
            f"ids {st.get('aux ids') or st.get('layer_ids')}")


def _points(doc: dict) -> Table:
    world = doc["settings"]["world_size"]
    rows = []
    for p in doc["points"]:
        row = [Cell(p["name"])]
        for r in range(world):
            s = p["per_rank"].get(str(r))
            row.append(Cell(cell_label(s), s.get("level", "?")) if s else
                       Cell("missing" if r in doc["ranks_missing"] else "—", style="dim"))
        rows.append(row)
    return Table("capture points × ranks", [Column("capture point")] + [Column(f"rank {r}") for r in range(world)],
                 rows, terminal={"show_lines": False, "header_style": "bold"})


def _slots(doc: dict) -> Table:
    rows = []
    for row in doc["slots"]:
        differ = slot_values_differ(doc, row)
        rows.append([Cell(str(row["slot"])), Cell(str(row["id"])), Cell(str(row["expected"])),
                     Cell(slot_holds(row), "ok" if row["ok"] else "failure"),
                     Cell(f"differ on ranks {differ}" if differ else "agree", "failure" if differ else "ok")])
    return Table("aux slots (what the draft model receives)",
                 [Column(c) for c in ("slot", "id", "expected", "holds", "values across ranks")], rows,
                 terminal={"header_style": "bold"})


def sections(doc: dict) -> list:
    from ..report.envinfo import env_line
    from ..report.sglang_plan import probe_plan_sections
    st = doc["settings"]
    out: list = [Rule("tpprobe rank-diff", f" — {title(st)}"), Text(env_line(doc), style="dim"), _points(doc)]
    cov = coverage_text(doc)
    if cov:
        bad = any(b for _, _, b in coverage_parts(doc))
        out.append(Text("coverage: " + cov, style="bold red" if bad else ""))
    ar = doc["allreduce"]
    if ar:
        missing = missing_allreduces(doc)
        out.append(Text("all-reduce audit: " + audit_text(ar, missing),
                        style="bold red" if ar.get("incomplete") or missing else ""))
    if doc.get("slots"):
        out.append(_slots(doc))
    out += probe_plan_sections(st)
    from ..report.drafter import drafter_sections
    out += drafter_sections(doc, TERMINAL)
    out.append(Text("verdict", style="bold", heading=True))
    for f in doc["findings"]:
        out.append(Text(f"  {f['line']}", level=f["severity"]))
        if f["severity"] != "info" and f.get("explain"):
            out.append(Text(f"    why: {f['explain']}", style="dim"))
        for c in f.get("consequences", [])[:5]:
            out.append(Text(f"    follows from it: {c}", style="dim"))
    if not doc["findings"]:
        out.append(Text("  " + verdict_lines(doc)[0],
                        style="bold green" if healthy_level(doc) == "ok" else "bold cyan"))
    out.append(Text(f"settings: tokens={st.get('tokens')} hidden={st.get('hidden')} layers={st.get('num_layers')} "
                    f"seed={st.get('seed')} exchange={st.get('exchange')} inject={st.get('inject') or '-'}  "
                    + timing_text(doc), style="dim"))
    if doc.get("out"):
        wrote = (doc.get("exchange") or {}).get("captured_bytes_per_rank")
        if doc.get("offline"):     # read back: the folder's report.json is the live run's, not this one
            out.append(Text(f"captures: {doc['out']} (this report is read from them and not saved)", style="dim"))
        else:
            out.append(Text(f"captures and report.json: {doc['out']}"
                            + (f" ({wrote / 1e6:.2f} MB per rank)" if wrote else ""), style="dim"))
    return out


def probe_report(doc: dict, capture_dir: Optional[Path] = None) -> Report:
    """The Report of a probe document: the terminal's sections, the HTML page's (heatmaps from the
    document's per-token stats; capture_dir is accepted for callers that have one) and the 59-line
    Markdown issue summary's."""
    return _report(doc, terminal=True)


def _report(doc: dict, terminal: bool) -> Report:
    """terminal=False: the files' sections only (a document read back may hold only what they show)."""
    from .page import MAX_LINES, html_sections, markdown_sections, page_title
    findings = doc.get("findings") or []
    verdict = [Cell(f["line"], f["severity"]) for f in findings] or [Cell(verdict_lines(doc)[0], healthy_level(doc))]
    drawn = sections(doc) if terminal else []
    for s in drawn:
        s.media = TERMINAL
    return Report(SCHEMA, page_title(doc.get("settings") or {}), doc, verdict=verdict,
                  sections=drawn + html_sections(doc) + markdown_sections(doc) + _acceptance(doc),
                  settings=doc.get("settings") or {},
                  environment=doc.get("environment") or {}, findings=findings, exit_code=doc.get("exit_code", 0),
                  tool=doc.get("tool", "tpprobe"), page=True, max_lines=MAX_LINES)


def _acceptance(doc: dict) -> list:
    """The engine's own acceptance (formats/acceptance.py) and the SGLang draft's replayed fix
    (cli/drafter.py), on every sink, when the capture folder has them."""
    st = doc.get("settings") or {}
    return [Text(f"{key}: {st[key]}", tag="p") for key in ("engine acceptance", "draft replay") if st.get(key)]


def render_html(doc: dict) -> str:
    """The probe document's HTML page."""
    from ..report.html import render_report_html
    return render_report_html(_report(doc, terminal=False))


def write_html(doc: dict, path: Path, capture_dir: Optional[Path] = None) -> None:
    """The probe document's HTML page, written atomically."""
    from ..report.emit import write_html as write
    write(_report(doc, terminal=False), path)


def render_markdown(doc: dict) -> str:
    """The probe document's Markdown issue summary."""
    from ..report.markdown import render_report_markdown
    return render_report_markdown(_report(doc, terminal=False))


def render(doc: dict, con) -> None:
    """The probe document drawn on a rich Console (the terminal's view)."""
    from ..report.terminal import draw
    draw(probe_report(doc), con)
