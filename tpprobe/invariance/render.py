"""tpprobe invariance's report as the shared Report (report/model.py): its sections, for the one sink.

The terminal gets the short cells (one symbol per level when the table is too wide); the HTML and
Markdown get every cell's number and hover text, the configurations and the settings."""
from __future__ import annotations

from pathlib import Path

from ..report.labels import LEVEL_MARK, LEVEL_STYLE
from .levels import human_bytes

COMPACT = LEVEL_MARK        # report/labels.py declares each level's symbol


def cell_text(cell: dict, short: bool = False) -> str:
    """short (the terminal): noise without its number (the verdict gives the first break's)."""
    lv = cell.get("level", "?")
    if lv == "reference":
        return "ref"
    if lv == "n/a":
        return "·"
    if lv == "noise" and short:
        return "noise"
    if lv in ("noise", "material") and cell.get("rel") is not None:
        m, ex = f"{cell['rel']:.0e}".split("e")
        return f"{lv} {m}e{int(ex)}"
    return lv


def row_label(e: dict) -> str:
    return f"⇄ {e['key']}" if e["kind"] == "collective" else e["key"]


def _firsts(report: dict) -> dict:
    return {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}


def _has_input(e: dict) -> bool:
    return bool(e["in_cells"]) and any(c["level"] != "n/a" for c in e["in_cells"].values())


def compact_fits(report: dict, width: int) -> bool:
    """Too wide for a terminal of `width` columns: one symbol per level (the legend says which)."""
    names = [x["name"] for x in report["configs"]]
    firsts = _firsts(report)

    def col_width(n):       # its widest cell (the first break's carries " ◀") + padding and border
        w = [len(n)] + [len(cell_text(e["cells"][n], short=True)) + (2 if firsts[n] == e["key"] else 0)
                        for e in report["rows"]]
        w += [len(cell_text(e["in_cells"][n], short=True)) for e in report["rows"] if e["in_cells"]]
        return max(w) + 3
    width_needed = max((len(row_label(e)) for e in report["rows"]), default=20) + sum(col_width(n) for n in names)
    return width_needed > width


def _terminal_table(report: dict, compact: bool):
    from ..report.model import TERMINAL, Cell, Column, Table
    names = [x["name"] for x in report["configs"]]
    firsts = _firsts(report)

    def cell(c, n, key=None):
        lv = c["level"]
        txt = COMPACT.get(lv, lv) if compact and lv in COMPACT else cell_text(c, short=True)
        return Cell(txt + (" ◀" if key is not None and firsts[n] == key else ""), lv, LEVEL_STYLE.get(lv, ""))
    rows = []
    for e in report["rows"]:
        rows.append([Cell(row_label(e))] + [cell(e["cells"][n], n, e["key"]) for n in names])
        if e["in_cells"] and any(c["level"] not in ("n/a",) for c in e["in_cells"].values()):
            rows.append([Cell("  └ its input", style="dim")] + [cell(e["in_cells"][n], n) for n in names])
    return Table("capture points and collectives (model order) × configurations",
                 [Column("point / collective", no_wrap=True)] + [Column(n) for n in names], rows,
                 terminal={"title_justify": "left", "show_lines": False, "pad_edge": False}, media=TERMINAL)


def _file_table(report: dict):
    from ..report.model import FILES, Cell, Column, Table
    names = [x["name"] for x in report["configs"]]
    firsts = _firsts(report)

    def cell(c, n, key, bytes_=None):
        hint = "; ".join(f"{k}={c[k]}" for k in ("rel", "max_abs", "ulp_max", "ranks", "vs", "why")
                         if c.get(k) not in (None, ""))
        if bytes_:
            hint += f"; message {human_bytes(bytes_)}"
        mark = " ◀" if key is not None and firsts[n] == key else ""
        return Cell(cell_text(c) + mark, c["level"], hint=hint or None)
    rows = []
    for e in report["rows"]:
        rows.append([row_label(e)] + [cell(e["cells"][n], n, e["key"], (e.get("bytes") or {}).get(n)) for n in names])
        if _has_input(e):
            rows.append([Cell("  └ its input (per rank)", style="dim")] + [cell(e["in_cells"][n], n, None)
                                                                          for n in names])
    return Table("capture points and collectives × configurations", [Column("point / collective")]
                 + [Column(n) for n in names], rows,
                 caption="◀ first row where bitwise equality breaks. Inputs are rank shards: compared with the same "
                         "TP size only (at the reference's batch).", media=FILES)


STATUS_LEVEL = {"bitwise": "ok", "noise": "noise", "single": "info"}
STATUS_STYLE = {"bitwise": "bold green", "single": "bold", "noise": "bold yellow"}


def invariance_report(report: dict, width: int = 120):
    """The invariance document as the shared Report; `width`: the terminal's columns (a table too wide for
    them shows one symbol per level)."""
    from ..report.model import FILES, TERMINAL, Cell, Column, KeyValue, Report, Rule, Table, Text
    st = report["settings"]
    compact = compact_fits(report, width)
    ops = sorted({o for e in report["rows"] for o in e["ops"].values() if o})
    v = report["verdict"]
    status_level = STATUS_LEVEL.get(v["status"], "failure")
    expect_level = "ok" if report["exit_code"] == 0 else "failure"
    verdict = [Cell(v["line"], status_level)] + [Cell(x) for x in v["lines"]] + \
        ([Cell(v["expect"], expect_level)] if v.get("expect") else [])
    kept = report.get("kept")
    extra = f"; --keep: {len(kept['files'])} tensor files for {kept['cells']} cells" if kept else ""
    fp = report.get("fingerprints") or {}
    per = f" ({human_bytes(fp['bytes_per_row'])} per row per rank and batch, in and out)" if fp else ""
    sections = [
        Rule("tpprobe invariance", f" — {st['model']} · {st['backend']} · {st['dtype']} · "
                                   f"reference {st['reference']} · expect {st['expect']}"),
        _terminal_table(report, compact), _file_table(report),
        Text(("= bitwise · ≈ rounding noise · ✗ material · " if compact else "")
             + "◀ first row where bitwise equality breaks · ⇄ a collective ("
             + ", ".join(ops or ["none ran"])
             + "; at tp 1 the output of the module that issues it) · its input: each rank's shard, compared "
             "at the same TP size only (with the reference's batch) · noise/material: the sketch's relative "
             "difference", style="dim"),
        Text("verdict", style="bold", media=TERMINAL),
        Text("  " + v["line"], status_level, STATUS_STYLE.get(v["status"], "bold red"), media=TERMINAL)]
    sections += [Text("  " + line, media=TERMINAL) for line in v["lines"]]
    if v.get("expect"):
        sections.append(Text("  " + v["expect"], expect_level, "bold green" if report["exit_code"] == 0 else "bold red",
                             media=TERMINAL))
    sections.append(Text(f"fingerprints{per} and report.json: {report.get('out')}{extra}", style="dim"))
    sections.append(Table("configurations", [Column(c) for c in ("config", "level", "prompt rows", "batch lengths",
                                                                 "first break")],
                          [[x["name"], Cell(str(x["level"]), x["level"] if x["level"] in LEVEL_STYLE else "reference"),
                            str(x["prompt_rows"]), str(x["lens"]),
                            (x["first_break"] or {}).get("line") or "—"] for x in report["configs"]], media=FILES))
    sections.append(KeyValue("settings", [(str(k), str(val)) for k, val in st.items()], media=FILES))
    title = f"tpprobe invariance — {st['model']} · {st['backend']} · {st['dtype']} · reference {st['reference']}"
    return Report(report["schema"], title, report, verdict=verdict, sections=sections, settings=st,
                  environment=report.get("environment") or {}, exit_code=report["exit_code"],
                  tool=report.get("tool", "tpprobe"))


def emit(report: dict, root: Path, opts) -> None:
    """report.json under the run's folder, then the shared sink (terminal or --json, --html, --markdown)."""
    from ..report.emit import emit as sink
    from ..report.emit import console
    sink(invariance_report(report, console().width or 120), root, opts.probe)
