"""`--html PATH`: the report as one self-contained HTML file.

Everything is inline: CSS in a <style>, heatmaps as data: PNG (matplotlib, Agg). No script, no
font, no link leaves the file, so it opens offline and can be attached to a bug report as is.
Order: verdict, environment header, capture point × rank table (colour = level), all-reduce audit,
per-point heatmaps (per-token max |diff| vs the reference rank), aux slots, settings, environment.
"""
from __future__ import annotations

import base64
import io
import math
from html import escape
from pathlib import Path
from typing import Optional

from ..capture.points import place_layer
from .envinfo import env_lines
from .labels import LEVEL_CLASS, cell_label, coverage_parts, verdict_items   # the terminal table's words

LEVEL_LEGEND = [("reference", "the rank the others are compared to"), ("bitwise", "identical bits"),
                ("noise", "differs within the dtype's rounding (reduction order)"),
                ("material", "differs beyond rounding: a bug"), ("shape", "shapes or dtypes differ"),
                ("own share", "a rank's own shard before the all-reduce: not compared")]
# an all-reduce complete within rounding is a healthy reduce: green like an exact one, never yellow
AUDIT_CLASS = {**LEVEL_CLASS, "noise": "ok"}
AUDIT_LABEL = {"noise": "complete (within rounding)", "exact": "complete (exact)"}
SEV_CLASS = {k: LEVEL_CLASS[k] for k in ("failure", "warning", "info")}

CSS = ("""
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1180px;padding:0 16px;color:#1f2328;background:#fff;font-size:14px;line-height:1.45}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
details{margin:8px 0}summary{cursor:pointer;color:#59636e}
h3{font-size:14px;margin:16px 0 4px;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.sub{color:#59636e;margin-bottom:12px}"""
"""code,.mono,td{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0}"""
"""th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600;font-family:inherit;font-size:13px}
td.ok{background:#dafbe1;color:#116329}td.ref{background:#ddf4ff;color:#0a3069}"""
"""td.noise{background:#fff8c5;color:#7d4e00}
td.bad{background:#ffebe9;color:#a40e26;font-weight:600}td.shape{background:#f3e8ff;color:#6b21a8;font-weight:600}
td.dim{color:#6e7781;background:#fafbfc}
.verdict{border-radius:6px;padding:8px 12px;margin:6px 0;border:1px solid}
.verdict.bad{background:#ffebe9;border-color:#ff8182;color:#82071e}"""
""".verdict.noise{background:#fff8c5;border-color:#d4a72c;color:#633c01}
.verdict.ref{background:#ddf4ff;border-color:#54aeff;color:#0a3069}"""
""".verdict.ok{background:#dafbe1;border-color:#4ac26b;color:#116329}
.verdict .line{font-weight:600;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
.verdict .why,.verdict li{color:#1f2328;font-size:13px}.verdict ul{margin:4px 0 0 0;padding-left:20px}
.env{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:6px 12px;margin:10px 0}
.env div{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.legend span{display:inline-block;padding:1px 8px;margin:2px 4px 2px 0;border:1px solid #d0d7de;border-radius:4px}
.legend .ok{background:#dafbe1}.legend .ref{background:#ddf4ff}.legend .noise{background:#fff8c5}"""
""".legend .bad{background:#ffebe9}
.legend .shape{background:#f3e8ff}.legend .dim{background:#fafbfc}
img.heat{max-width:100%;display:block;border:1px solid #d0d7de}
.heatgrid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:8px 16px}
footer{margin-top:32px;color:#6e7781;font-size:12px}
""")


def _e(x) -> str:
    return escape(str(x), quote=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)




def _cell_title(s: dict) -> str:
    keys = ("max_abs", "mean_abs", "rel_diff", "ulp_max", "first_token", "bad_fraction", "nan_mismatch",
            "dtype", "shape")
    return "; ".join(f"{k}={_fmt(s[k])}" for k in keys if k in s and s[k] is not None)


# ---- heatmaps ----------------------------------------------------------------------------------
def heat_matrix(point: dict, world: int):
    """(ranks × tokens array of max |diff| vs the reference rank, NaN where not compared) or None."""
    import numpy as np
    rows = {int(r): s.get("heat") for r, s in point.get("per_rank", {}).items() if s.get("heat")}
    if not rows:
        return None
    n = max(len(h) for h in rows.values())
    m = np.full((world, n), np.nan)
    ref = point.get("reference_rank")
    if ref is not None and 0 <= int(ref) < world:
        m[int(ref), :] = 0.0
    for r, h in rows.items():
        if 0 <= r < world:
            m[r, :len(h)] = h
    return m


def heat_png(name: str, m, vmax: float, tokens: Optional[int] = None, missing: tuple = (),
             ref: Optional[int] = None) -> bytes:
    """One heatmap as PNG bytes: ranks down, tokens across, log colour scale shared across points."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    world, n = m.shape
    floor = 1e-9
    vmax = max(vmax, floor * 10)
    zero = m == 0
    shown = np.ma.masked_invalid(np.where(zero, np.nan, np.clip(m, floor, None)))
    h_in = 0.85 + 0.3 * world
    fig = Figure(figsize=(6.4, h_in), dpi=100)
    fig.patch.set_facecolor("white")
    ax = fig.add_axes((0.12, 0.5 / h_in, 0.74, 1 - 0.8 / h_in))
    cax = fig.add_axes((0.875, 0.5 / h_in, 0.015, 1 - 0.8 / h_in))
    cmap = matplotlib.colormaps["YlOrRd"].with_extremes(bad=(0, 0, 0, 0))
    # underneath the log map: bitwise-equal entries green, entries not compared grey
    base = np.where(zero, 1.0, np.where(np.isnan(m), 0.0, np.nan))
    ax.imshow(np.ma.masked_invalid(base), aspect="auto", interpolation="nearest",
              cmap=matplotlib.colors.ListedColormap(["#e8eaed", "#8fd19e"]), vmin=0, vmax=1)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=LogNorm(vmin=floor, vmax=vmax))
    ax.set_yticks(range(world))
    ax.set_yticklabels([f"rank {r}" + (" (ref)" if r == ref else " (missing)" if r in missing else "")
                        for r in range(world)], fontsize=8)
    label = "token" if tokens is None or tokens == n else f"token bin ({tokens} tokens → {n} bins, max per bin)"
    ax.set_xlabel(label, fontsize=8, labelpad=1)
    step = max(1, int(math.ceil(n / 16)))
    ax.set_xticks(range(0, n, step))
    ax.tick_params(axis="x", labelsize=7, pad=1)
    ax.set_title(f"{name}: max |x − x_ref| per token", fontsize=9, loc="left", pad=3)
    cb = fig.colorbar(im, cax=cax)
    cb.set_ticks([t for t in (1e-8, 1e-6, 1e-4, 1e-2, 1, 1e2, 1e4) if floor <= t <= vmax])
    cb.ax.tick_params(labelsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": f"matplotlib {matplotlib.__version__} (tpprobe)"})
    return buf.getvalue()


def _img(png: bytes, alt: str) -> str:
    return f'<img class="heat" alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


# ---- sections ----------------------------------------------------------------------------------
def _verdict(report: dict) -> str:
    out = ['<section id="verdict"><h2>Verdict</h2>']
    for f in verdict_items(report):
        cls = SEV_CLASS.get(f.get("severity"), "ok")
        out.append(f'<div class="verdict {cls}"><div class="line">{_e(f["line"])}</div>')
        if f.get("severity") not in ("info", "ok") and f.get("explain"):
            out.append(f'<div class="why">why: {_e(f["explain"])}</div>')
        cons = f.get("consequences") or []
        if cons:
            out.append("<ul>" + "".join(f"<li>follows from it: {_e(c)}</li>" for c in cons) + "</ul>")
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


BAD_ATTR = ' class="bad"'


def _coverage(report: dict) -> str:
    """What was hooked and audited: part of the verdict (HEALTHY only with complete coverage)."""
    rows = coverage_parts(report)
    if not rows:
        return ""
    return ('<section id="coverage"><h2>Coverage</h2><table class="coverage"><tbody>'
            + "".join(f'<tr><th>{_e(what)}</th><td{BAD_ATTR if bad else ""}>{_e(text)}</td></tr>'
                      for what, text, bad in rows)
            + "</tbody></table></section>")


def _env_header(report: dict) -> str:
    return '<div class="env" id="env-header">' + "".join(f"<div>{_e(l)}</div>" for l in env_lines(report)) + "</div>"


def _points_table(report: dict, world: int) -> str:
    missing = set(report.get("ranks_missing") or [])
    out = ['<section id="points"><h2>Capture points × ranks</h2>', '<div class="legend">',
           "".join(f'<span class="{LEVEL_CLASS.get(k if k != "own share" else "share", "dim")}" '
                   f'title="{_e(v)}">{_e(k)}</span>'
                   for k, v in LEVEL_LEGEND), "</div>",
           '<table class="points"><thead><tr><th>capture point</th><th>layer</th>']
    out += [f"<th>rank {r}</th>" for r in range(world)]
    out.append("</tr></thead><tbody>")
    for p in report.get("points", []):
        out.append(f'<tr><td>{_e(p["name"])}</td><td>{_e("" if p.get("layer") is None else p["layer"])}</td>')
        for r in range(world):
            s = p.get("per_rank", {}).get(str(r))
            if s:
                lv = s.get("level", "?")
                out.append(f'<td class="{LEVEL_CLASS.get(lv, "")}" '
                           f'title="{_e(_cell_title(s))}">{_e(cell_label(s))}</td>')
            else:
                out.append(f'<td class="dim">{"missing" if r in missing else "—"}</td>')
        out.append("</tr>")
    out.append("</tbody></table></section>")
    return "".join(out)


def _where_layer(where) -> int:
    """The layer of an audit place: "embed" is -1, "layer.K" is K, any other after every layer."""
    k = place_layer(where)
    return k if k is not None else 1 << 30


def _allreduce(report: dict, world: int) -> str:
    ar = report.get("allreduce") or {}
    out = ['<section id="allreduce"><h2>All-reduce audit</h2>']
    if not ar:
        return "".join(out) + "<p>no all-reduce recorded</p></section>"
    from .labels import audit_text, missing_allreduces
    missing = missing_allreduces(report)
    out.append(f"<p>{_e(audit_text(ar, missing))}</p>")
    recs = list(ar.get("records") or [])
    for m in missing:     # the reduce that never ran gets its row where it should have run
        at = next((i for i, rec in enumerate(recs) if _where_layer(rec.get("where")) >= _where_layer(m["where"])),
                  len(recs))
        recs.insert(at, {"seq": "—", "where": m["where"], "module": m["module"], "level": "missing",
                         "missing_ranks": m["ranks"]})
    if recs:
        out.append('<table class="allreduce"><thead><tr><th>seq</th><th>where</th><th>module</th><th>shape</th>'
                   '<th>group</th><th>level</th>' + "".join(f"<th>rank {r}</th>"
                                                            for r in range(world)) + "</tr></thead><tbody>")
        for rec in recs:
            lv = rec.get("level", "?")
            if lv == "missing":
                out.append(f'<tr class="missing"><td>—</td><td>{_e(rec["where"])}</td><td>{_e(rec["module"])}</td>'
                           '<td>—</td><td>—</td><td class="bad">never issued</td>'
                           + "".join('<td class="bad">not issued</td>' if r in rec["missing_ranks"] else "<td>—</td>"
                                     for r in range(world)) + "</tr>")
                continue
            out.append(f'<tr><td>{_e(rec.get("seq"))}</td><td>{_e(rec.get("where"))}</td>'
                       f'<td>{_e(rec.get("module"))}</td>'
                       f'<td>{_e(rec.get("shape"))}</td><td>{_e(rec.get("group_size"))}</td>'
                       f'<td class="{AUDIT_CLASS.get(lv, "")}">{_e(AUDIT_LABEL.get(lv, lv))}</td>')
            for r in range(world):
                s = (rec.get("per_rank") or {}).get(str(r))
                if s:
                    txt = s.get("level", "?") + (f' {s["rel_diff"]:.2g}' if isinstance(s.get("rel_diff"), (int, float))
                                                 and s.get("rel_diff") else "")
                    out.append(f'<td class="{AUDIT_CLASS.get(s.get("level"), "")}" '
                               f'title="{_e(_cell_title(s))}">{_e(txt)}</td>')
                else:
                    out.append('<td class="dim">—</td>')
            out.append("</tr>")
        out.append("</tbody></table>")
    return "".join(out) + "</section>"


HEATMAPS_MISSING = ("per-token heatmaps need matplotlib, which is not installed: pip install 'tpprobe[html]' "
                    "(or pip install matplotlib), then re-render with tpprobe report DIR --html FILE")


def _heatmaps(report: dict, world: int) -> str:
    out = ['<section id="heatmaps"><h2>Where ranks differ: per-token heatmaps</h2>',
           '<p class="sub">Max |difference| to the reference rank per token (columns) and rank (rows), on one log '
           'colour '
           'scale for all points. Green: bitwise equal; grey: not compared (reference-free shares, missing ranks). '
           'A divergence confined to some tokens (say, those of one vocab shard) shows as columns.</p>',
           '<div class="heatgrid">']
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:   # an extra: a serving environment need not carry matplotlib
        out += [f'<p class="missing-heatmaps">{_e(HEATMAPS_MISSING)}</p>', "</div></section>"]
        return "".join(out)
    mats = []
    for p in report.get("points", []):
        m = heat_matrix(p, world)
        if m is not None:
            mats.append((p, m))
    import numpy as np
    finite = [float(np.nanmax(m)) for _, m in mats if np.isfinite(m).any()]
    vmax = max(finite + [1e-6])
    missing = tuple(report.get("ranks_missing") or [])
    tokens = report.get("settings", {}).get("tokens")
    differ = [(p, m) for p, m in mats if np.nan_to_num(m).any()]
    same = [(p, m) for p, m in mats if not np.nan_to_num(m).any()]

    def one(p, m) -> str:
        png = heat_png(p["name"], m, vmax, tokens=tokens, missing=missing, ref=p.get("reference_rank"))
        return (f'<div class="hm"><h3>{_e(p["name"])} <span class="sub">({_e(p.get("level", "?"))}, max '
                f'{float(np.nanmax(m)):.3g})</span></h3>{_img(png, "heatmap " + p["name"])}</div>')

    out += [one(p, m) for p, m in differ]
    if not differ:
        out.append("<p>every compared capture point is bitwise equal on every rank</p>" if mats else
                   "<p>no per-token differences recorded (no rank was compared)</p>")
    out.append("</div>")
    if same:   # the all-green maps, folded (no script: <details> opens by itself)
        out.append(f'<details><summary>{len(same)} capture point(s) bitwise equal on every rank: '
                   f'{_e(", ".join(p["name"] for p, _ in same))}</summary><div class="heatgrid">'
                   + "".join(one(p, m) for p, m in same) + "</div></details>")
    out.append("</section>")
    return "".join(out)


def _slots(report: dict) -> str:
    slots = report.get("slots") or []
    if not slots:
        return ""
    from .labels import slot_values_differ
    out = ['<section id="slots"><h2>Aux slots (what the draft model receives)</h2><table class="slots"><thead><tr>'
           '<th>slot</th><th>id</th><th>expected</th><th>holds</th><th>values across ranks</th></tr></thead><tbody>']
    for s in slots:
        differ = slot_values_differ(report, s)
        out.append(f'<tr><td>{_e(s.get("slot"))}</td><td>{_e(s.get("id"))}</td><td>{_e(s.get("expected"))}</td>'
                   f'<td class="{"ok" if s.get("ok") and not differ else "bad"}">{_e(s.get("matched"))}</td>'
                   f'<td class="{"bad" if differ else "ok"}">'
                   f'{_e(f"differ on ranks {differ}" if differ else "agree")}</td></tr>')
    return "".join(out) + "</tbody></table></section>"


def _kv_table(d: dict, cls: str) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v) if not isinstance(v, (list, dict)) else v)}</td></tr>"
                   for k, v in d.items() if k not in ("gpus", "topology"))
    return f'<table class="{cls}">{rows}</table>'


def _settings_env(report: dict) -> str:
    st = dict(report.get("settings") or {})
    out = ['<section id="settings"><h2>Settings</h2>', _kv_table(st, "settings")]
    from .labels import timing_text
    tm = timing_text(report)
    if tm:
        out.append(f"<p>{_e(tm)}</p>")
    out.append("</section>")
    env = report.get("environment") or {}
    out.append('<section id="environment"><h2>Environment</h2>' + _kv_table(env, "environment"))
    gpus = env.get("gpus") or []
    if gpus:
        cols = ["rank", "index", "name", "memory_gib", "pci", "uuid"]
        out.append("<h3>GPUs</h3><table class=\"gpus\"><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"
                   + "".join("<tr>" + "".join(f"<td>{_e(g.get(c, ''))}</td>" for c in cols) + "</tr>" for g in gpus)
                   + "</table>")
    topo = env.get("topology")
    if topo and topo.get("matrix"):
        rk = topo["ranks"]
        out.append("<h3>Topology between the ranks' GPUs (NVML; NV<i>k</i> = k NVLinks, else the PCIe path)</h3>"
                   "<table class=\"topo\"><tr><th></th>" + "".join(f"<th>rank {r}</th>" for r in rk) + "</tr>"
                   + "".join(f"<tr><th>rank {r}</th>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
                             for r, row in zip(rk, topo["matrix"])) + "</table>")
        p2p = [p for p in topo.get("pairs", []) if p.get("p2p_read")]
        if p2p:
            out.append("<p>P2P read: " + "; ".join(f"{a}-{b} {_e(p['p2p_read'])}" for p in p2p
                                                    for a, b in [p["ranks"]]) + "</p>")
    out.append("</section>")
    return "".join(out)


def _body(report: dict, world: int) -> list[str]:
    """The tables in the order that explains the verdict: a slot fault's slot table first."""
    from .labels import slot_fault_first
    tables = [_points_table(report, world), _allreduce(report, world), _heatmaps(report, world)]
    slots = _slots(report)
    return [slots, *tables] if slot_fault_first(report) else [*tables, slots]


def render_html(report: dict) -> str:
    st = report.get("settings") or {}
    world = int(st.get("world_size") or 1)
    title = (f"tpprobe rank-diff — {st.get('model')} · tp={world} · {st.get('backend')} · {st.get('dtype')} · "
             f"ids {st.get('layer_ids')}")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             f'<div class="sub">{_e(report.get("tool", "tpprobe"))} · exit code {_e(report.get("exit_code", "?"))}'
             + (f' · captures: <code>{_e(report["out"])}</code>' if report.get("out") else "") + "</div>",
             _verdict(report), _coverage(report), _env_header(report), *_body(report, world), _settings_env(report),
             f'<footer>{_e(report.get("schema", ""))} · generated by {_e(report.get("tool", "tpprobe"))}</footer>',
             "</body></html>"]
    return "\n".join(parts)


def write_html(report: dict, path: Path, capture_dir: Optional[Path] = None) -> None:
    """Write the report as one self-contained HTML file (atomically). capture_dir is accepted for
    callers that have one; the heatmaps come from the report's per-token stats."""
    from ..formats.capture_dir import atomic_write_bytes
    from ..formats.capture_dir import make_file_folder
    path = Path(path)
    make_file_folder(path, "--html")
    atomic_write_bytes(path, render_html(report).encode("utf-8"))


# ---- any Report: its sections, generically -----------------------------------------------------------
def _section_cell(c, tag: str = "td") -> str:
    if isinstance(c, str):
        return f"<{tag}>{_e(c)}</{tag}>"
    cls = LEVEL_CLASS.get(c.level or "", "dim" if c.style == "dim" else "")
    attrs = (f' class="{cls}"' if cls else "") + (f' title="{_e(c.hint)}"' if c.hint else "")
    return f"<{tag}{attrs}>{_e(c.text)}</{tag}>"


def _section_html(s) -> str:
    from .model import KeyValue, Table, Text
    if isinstance(s, Text):
        if s.heading:
            return f"<h2>{_e(s.plain.strip())}</h2>"
        body = "".join(_section_cell(c, "span") for c in s.cells())
        return f'<p class="mono">{body}</p>'
    if isinstance(s, Table):
        out = [f"<h2>{_e(s.title)}</h2>" if s.title else "", "<table><thead><tr>"
               + "".join(f"<th>{_e(c.name)}</th>" for c in s.columns) + "</tr></thead><tbody>"]
        out += ["<tr>" + "".join(_section_cell(c) for c in row) + "</tr>" for row in s.rows]
        out.append("</tbody></table>" + (f'<p class="sub">{_e(s.caption)}</p>' if s.caption else ""))
        return "".join(out)
    if isinstance(s, KeyValue):
        return ((f"<h2>{_e(s.title)}</h2>" if s.title else "") + "<table><tbody>"
                + "".join(f"<tr><th>{_e(k)}</th>{_section_cell(v)}</tr>" for k, v in s.items) + "</tbody></table>")
    return ""


def render_report_html(report) -> str:
    """A Report (report/model.py) as one self-contained HTML page: title, verdict, every HTML section in
    order, the environment; inline CSS, no script, no link leaves the file."""
    worst = next((c.level for c in report.verdict if LEVEL_CLASS.get(c.level or "") == "bad"), None)
    box = LEVEL_CLASS.get(worst or (report.verdict[0].level if report.verdict else "") or "", "ok")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_e(report.title)}</title><style>{CSS}</style></head><body>", f"<h1>{_e(report.title)}</h1>",
             f'<div class="sub">{_e(report.tool)} · exit code {report.exit_code}</div>',
             f'<section id="verdict"><h2>Verdict</h2><div class="verdict {box or "ok"}">'
             + "".join(f'<div class="line">{_e(c.text)}</div>' for c in report.verdict) + "</div></section>"]
    parts += [_section_html(s) for s in report.sections if "html" in s.media]
    env = env_lines({"environment": report.environment, "settings": report.settings}) if report.environment else []
    if env:
        parts.append('<h2>Environment</h2><div class="env">' + "".join(f"<div>{_e(x)}</div>" for x in env) + "</div>")
    parts.append(f"<footer>{_e(report.schema)} · generated by {_e(report.tool)}</footer></body></html>")
    return "\n".join(parts)


def write_report_html(report, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes, make_file_folder
    path = Path(path)
    make_file_folder(path, "--html")
    atomic_write_bytes(path, render_report_html(report).encode("utf-8"))
