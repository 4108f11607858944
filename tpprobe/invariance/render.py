"""tpprobe invariance's report: report.json, the terminal table, --json, --html and --markdown."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .levels import human_bytes

COMPACT = {"bitwise": "=", "noise": "≈", "material": "✗", "shape": "✗ shape", "missing": "✗ missing"}
LEVEL_STYLE = {"bitwise": "green", "reference": "cyan", "noise": "yellow", "material": "bold red",
               "shape": "bold red", "missing": "bold red", "n/a": "dim"}


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


def render(report: dict, con) -> None:
    from rich.table import Table
    from rich.text import Text
    st = report["settings"]
    con.rule(f"[bold]tpprobe invariance[/] — {st['model']} · {st['backend']} · {st['dtype']} · "
             f"reference {st['reference']} · expect {st['expect']}")
    t = Table(title="capture points and collectives (model order) × configurations", title_justify="left",
              show_lines=False, pad_edge=False)
    t.add_column("point / collective", no_wrap=True)
    names = [x["name"] for x in report["configs"]]
    for n in names:
        t.add_column(n)
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    # too wide for the terminal: one symbol per level (the legend says which)
    def col_width(n):       # its widest cell (the first break's carries " ◀") + padding and border
        w = [len(n)] + [len(cell_text(e["cells"][n], short=True)) + (2 if firsts[n] == e["key"] else 0)
                        for e in report["rows"]]
        w += [len(cell_text(e["in_cells"][n], short=True)) for e in report["rows"] if e["in_cells"]]
        return max(w) + 3
    width = max((len(row_label(e)) for e in report["rows"]), default=20) + sum(col_width(n) for n in names)
    compact = width > (con.width or 120)

    def text(c, key=None):
        lv = c["level"]
        txt = COMPACT.get(lv, lv) if compact and lv in COMPACT else cell_text(c, short=True)
        return Text(txt + (" ◀" if key is not None and firsts[n] == key else ""), style=LEVEL_STYLE.get(lv, ""))
    for e in report["rows"]:
        cells = []
        for n in names:
            cells.append(text(e["cells"][n], e["key"]))
        t.add_row(Text(row_label(e)), *cells)
        if e["in_cells"] and any(c["level"] not in ("n/a",) for c in e["in_cells"].values()):
            t.add_row(Text("  └ its input", style="dim"), *[text(e["in_cells"][n]) for n in names])
    con.print(t)
    ops = sorted({o for e in report["rows"] for o in e["ops"].values() if o})
    con.print(Text(("= bitwise · ≈ rounding noise · ✗ material · " if compact else "")
                   + "◀ first row where bitwise equality breaks · ⇄ a collective ("
                   + ", ".join(ops or ["none ran"])
                   + "; at tp 1 the output of the module that issues it) · its input: each rank's shard, compared "
                   "at the same TP size only (with the reference's batch) · noise/material: the sketch's relative "
                   "difference", style="dim"))
    v = report["verdict"]
    style = {"bitwise": "bold green", "single": "bold"}.get(v["status"], "bold yellow" if v["status"] == "noise"
                                                            else "bold red")
    con.print(Text("verdict", style="bold"))
    con.print(Text("  " + v["line"], style=style))
    for line in v["lines"]:
        con.print(Text("  " + line))
    if v.get("expect"):
        con.print(Text("  " + v["expect"], style="bold green" if report["exit_code"] == 0 else "bold red"))
    kept = report.get("kept")
    extra = f"; --keep: {len(kept['files'])} tensor files for {kept['cells']} cells" if kept else ""
    fp = report.get("fingerprints") or {}
    per = f" ({human_bytes(fp['bytes_per_row'])} per row per rank and batch, in and out)" if fp else ""
    con.print(Text(f"fingerprints{per} and report.json: {report.get('out')}{extra}", style="dim"))


def render_markdown(report: dict) -> str:
    st = report["settings"]
    names = [x["name"] for x in report["configs"]]
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    out = [f"### tpprobe invariance: {st['model']} · {st['backend']} · {st['dtype']} · reference "
           f"{st['reference']} · expect {st['expect']}", "", f"**{report['verdict']['line']}**", ""]
    out += [f"- {line}" for line in report["verdict"]["lines"]]
    if report["verdict"].get("expect"):
        out.append(f"- {report['verdict']['expect']}")
    out += ["", "| point / collective | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def md(c, n, key):
        txt = cell_text(c).replace("|", "\\|") + (" ◀" if key is not None and firsts[n] == key else "")
        return f"**{txt}**" if c["level"] in ("material", "shape", "missing") else txt
    for e in report["rows"]:
        out.append(f"| `{row_label(e)}` | " + " | ".join(md(e["cells"][n], n, e["key"]) for n in names) + " |")
        if e["in_cells"] and any(c["level"] != "n/a" for c in e["in_cells"].values()):
            out.append("| └ its input | " + " | ".join(md(e["in_cells"][n], n, None) for n in names) + " |")
    from ..report.envinfo import env_lines
    out += ["", "<details><summary>environment</summary>", "", *[f"    {x}" for x in env_lines(report)], "",
            "</details>", ""]
    return "\n".join(out)


def render_html(report: dict) -> str:
    from html import escape
    from ..report.html import CSS
    st = report["settings"]
    names = [x["name"] for x in report["configs"]]
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    cls = {"bitwise": "ok", "reference": "ref", "noise": "noise", "material": "bad", "shape": "shape",
           "missing": "bad", "n/a": "dim"}
    v = report["verdict"]
    vcls = {"bitwise": "ok", "noise": "noise", "single": "ref"}.get(v["status"], "bad")

    def e_(x):
        return escape(str(x), quote=True)

    def td(c, n, key, bytes_=None):
        title = "; ".join(f"{k}={c[k]}" for k in ("rel", "max_abs", "ulp_max", "ranks", "vs", "why") if c.get(k) not in
                          (None, ""))
        if bytes_:
            title += f"; message {human_bytes(bytes_)}"
        mark = " ◀" if key is not None and firsts[n] == key else ""
        return f'<td class="{cls.get(c["level"], "")}" title="{e_(title)}">{e_(cell_text(c))}{mark}</td>'
    title = f"tpprobe invariance — {st['model']} · {st['backend']} · {st['dtype']} · reference {st['reference']}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{e_(title)}</title><style>{CSS}</style></head><body>", f"<h1>{e_(title)}</h1>",
             f'<div class="sub">{e_(report["tool"])} · exit code {report["exit_code"]} · expect {e_(st["expect"])}'
             f' · output <code>{e_(report.get("out"))}</code></div>',
             f'<div class="verdict {vcls}"><div class="line">{e_(v["line"])}</div><ul>'
             + "".join(f"<li>{e_(x)}</li>" for x in v["lines"])
             + (f"<li>{e_(v['expect'])}</li>" if v.get("expect") else "") + "</ul></div>",
             "<h2>capture points and collectives × configurations</h2><table><tr><th>point / collective</th>"
             + "".join(f"<th>{e_(n)}</th>" for n in names) + "</tr>"]
    for e in report["rows"]:
        parts.append(f"<tr><td>{e_(row_label(e))}</td>"
                     + "".join(td(e["cells"][n], n, e["key"], (e.get("bytes") or {}).get(n)) for n in names) + "</tr>")
        if e["in_cells"] and any(c["level"] != "n/a" for c in e["in_cells"].values()):
            parts.append('<tr><td class="dim">&nbsp;&nbsp;└ its input (per rank)</td>'
                         + "".join(td(e["in_cells"][n], n, None) for n in names) + "</tr>")
    parts.append("</table><p class=\"sub\">◀ first row where bitwise equality breaks. Inputs are rank shards: "
                 "compared with the same TP size only (at the reference's batch). Hover a cell for its numbers.</p>")
    parts.append("<h2>configurations</h2><table><tr><th>config</th><th>level</th><th>prompt rows</th>"
                 "<th>batch lengths</th><th>first break</th></tr>")
    for x in report["configs"]:
        fb = x["first_break"]
        parts.append(f'<tr><td>{e_(x["name"])}</td><td class="{cls.get(x["level"], "ref")}">{e_(x["level"])}</td>'
                     f'<td>{e_(x["prompt_rows"])}</td><td>{e_(x["lens"])}</td>'
                     f'<td>{e_(fb["line"] if fb else "—")}</td></tr>')
    parts.append("</table><h2>settings</h2><table>" + "".join(
        f"<tr><th>{e_(k)}</th><td>{e_(val)}</td></tr>" for k, val in st.items()) + "</table>")
    parts.append(f"<footer>{e_(report['schema'])} · generated by {e_(report['tool'])}</footer></body></html>")
    return "\n".join(parts)


def emit(report: dict, root: Path, opts) -> None:
    from ..formats.capture_dir import atomic_write_bytes
    p = opts.probe
    atomic_write_bytes(root / "report.json", json.dumps(report, indent=1, default=str).encode())
    if p.json_out:
        sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    elif not p.quiet:
        from ..report.terminal import console
        render(report, console())
    if p.html:
        atomic_write_bytes(Path(p.html), render_html(report).encode("utf-8"))
    if p.markdown:
        atomic_write_bytes(Path(p.markdown), render_markdown(report).encode("utf-8"))
