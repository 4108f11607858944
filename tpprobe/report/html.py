"""`--html PATH`: a Report as one self-contained HTML page, its sections laid out (no domain fact computed).

Everything is inline: CSS in a <style>, heatmaps as data: PNG (matplotlib, Agg). No script, no
font, no link leaves the file, so it opens offline and can be attached to a bug report as is.
It reads report.model and report.labels only: each command's builder decides what the page says.
"""
from __future__ import annotations

import base64
import io
import math
from html import escape

from .labels import LEVEL_CLASS
from .model import Block, Bullets, Callout, Cell, Fold, Heatmap, Heatmaps, KeyValue, Report, Row, Table, Text

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


# ---- heatmaps ----------------------------------------------------------------------------------
FLOOR = 1e-9     # the log scale's lowest value
HEATMAPS_MISSING = ("per-token heatmaps need matplotlib, which is not installed: pip install 'tpprobe[html]' "
                    "(or pip install matplotlib), then re-render with tpprobe report DIR --html FILE")


def heat_png(h: Heatmap) -> bytes:
    """One heatmap as PNG bytes: rows down, columns across, on a log colour scale up to h.vmax; cells of
    level bitwise green underneath, cells of level n/a grey."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    m = np.array([[np.nan if v is None else v for v in row] for row in h.values], dtype=float)
    lv = np.array([[x or "" for x in row] for row in h.levels], dtype=object)
    world, n = len(h.rows), h.columns
    floor = FLOOR
    vmax = max(h.vmax, floor * 10)
    zero = lv == "bitwise"
    shown = np.ma.masked_invalid(np.where(zero, np.nan, np.clip(m, floor, None)))
    h_in = 0.85 + 0.3 * world
    fig = Figure(figsize=(6.4, h_in), dpi=100)
    fig.patch.set_facecolor("white")
    ax = fig.add_axes((0.12, 0.5 / h_in, 0.74, 1 - 0.8 / h_in))
    cax = fig.add_axes((0.875, 0.5 / h_in, 0.015, 1 - 0.8 / h_in))
    cmap = matplotlib.colormaps["YlOrRd"].with_extremes(bad=(0, 0, 0, 0))
    base = np.where(zero, 1.0, np.where(lv == "n/a", 0.0, np.nan))
    ax.imshow(np.ma.masked_invalid(base), aspect="auto", interpolation="nearest",
              cmap=matplotlib.colors.ListedColormap(["#e8eaed", "#8fd19e"]), vmin=0, vmax=1)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=LogNorm(vmin=floor, vmax=vmax))
    ax.set_yticks(range(world))
    ax.set_yticklabels(h.rows, fontsize=8)
    ax.set_xlabel(h.xlabel, fontsize=8, labelpad=1)
    step = max(1, int(math.ceil(n / 16)))
    ax.set_xticks(range(0, n, step))
    ax.tick_params(axis="x", labelsize=7, pad=1)
    ax.set_title(h.chart, fontsize=9, loc="left", pad=3)
    cb = fig.colorbar(im, cax=cax)
    cb.set_ticks([t for t in (1e-8, 1e-6, 1e-4, 1e-2, 1, 1e2, 1e4) if floor <= t <= vmax])
    cb.ax.tick_params(labelsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": f"matplotlib {matplotlib.__version__} (tpprobe)"})
    return buf.getvalue()


def _heatmap(h: Heatmap) -> str:
    png = heat_png(h)
    img = f'<img class="heat" alt="{_e("heatmap " + h.title)}" ' \
          f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    return f'<div class="hm"><h3>{_e(h.title)} <span class="sub">{_e(h.note)}</span></h3>{img}</div>'


def _heatmaps(s: Heatmaps) -> str:
    out = ['<div class="heatgrid">']
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:   # an extra: a serving environment need not carry matplotlib
        if not s.maps:    # nothing differs: the line says so, and no picture is missed
            return "".join(out + [f"<p>{_e(s.empty)}</p>", "</div>"])
        return "".join(out + [f'<p class="missing-heatmaps">{_e(HEATMAPS_MISSING)}</p>', "</div>"])
    out += [_heatmap(h) for h in s.maps]
    if not s.maps:
        out.append(f"<p>{_e(s.empty)}</p>")
    out.append("</div>")
    if s.folded:   # folded (no script: <details> opens by itself)
        out.append(f"<details><summary>{_e(s.fold)}</summary><div class=\"heatgrid\">"
                   + "".join(_heatmap(h) for h in s.folded) + "</div></details>")
    return "".join(out)


# ---- sections ----------------------------------------------------------------------------------
def _class(c: Cell) -> str:
    return LEVEL_CLASS.get(c.level or "", "dim" if c.style == "dim" else "")


def _section_cell(c, tag: str = "td") -> str:
    if isinstance(c, str):
        return f"<{tag}>{_e(c)}</{tag}>"
    cls = _class(c)
    attrs = (f' class="{cls}"' if cls else "") + (f' title="{_e(c.hint)}"' if c.hint is not None else "")
    return f"<{tag}{attrs}>{_e(c.text)}</{tag}>"


def _inline(c: Cell) -> str:
    """A piece of a line: code, italic, a span with its level's class, or the text as it is."""
    if c.style == "code":
        return f"<code>{_e(c.text)}</code>"
    if c.style == "italic":
        return f"<i>{_e(c.text)}</i>"
    if _class(c) or c.hint is not None:
        return _section_cell(c, "span")
    return _e(c.text)


def _attrs(css: str, anchor: str = "") -> str:
    return (f' class="{css}"' if css else "") + (f' id="{anchor}"' if anchor else "")


def _row(row, row_headers: bool) -> str:
    css, cells = (row.css, row.cells) if isinstance(row, Row) else ("", row)
    head = cells[:1] if row_headers else []
    return (f"<tr{_attrs(css)}>" + "".join(_section_cell(c, "th") for c in head)
            + "".join(_section_cell(c) for c in cells[len(head):]) + "</tr>")


def _table(s: Table) -> str:
    if s.css is None:
        out = [f"<h2>{_e(s.title)}</h2>" if s.title else "", "<table><thead><tr>"
               + "".join(f"<th>{_e(c.name)}</th>" for c in s.columns) + "</tr></thead><tbody>"]
        out += ["<tr>" + "".join(_section_cell(c) for c in row) + "</tr>" for row in s.rows]
        out.append("</tbody></table>" + (f'<p class="sub">{_e(s.caption)}</p>' if s.caption else ""))
        return "".join(out)
    head = "<tr>" + "".join(f"<th>{_e(c.name)}</th>" for c in s.columns) + "</tr>"
    rows = "".join(_row(r, s.row_headers) for r in s.rows)
    if s.bare:
        return f"<table{_attrs(s.css)}>{head}{rows}</table>"
    return f"<table{_attrs(s.css)}><thead>{head}</thead><tbody>{rows}</tbody></table>"


def _kv(s: KeyValue) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th>{_section_cell(v)}</tr>" for k, v in s.items)
    if s.css is None:
        return (f"<h2>{_e(s.title)}</h2>" if s.title else "") + f"<table><tbody>{rows}</tbody></table>"
    return f"<table{_attrs(s.css)}>{rows}</table>" if s.bare else f"<table{_attrs(s.css)}><tbody>{rows}</tbody></table>"


def _text(s: Text) -> str:
    if s.tag is None:
        if s.heading:
            return f"<h2>{_e(s.plain.strip())}</h2>"
        return '<p class="mono">' + "".join(_section_cell(c, "span") for c in s.cells()) + "</p>"
    return f"<{s.tag}{_attrs(s.css, s.anchor)}>" + "".join(_inline(c) for c in s.cells()) + f"</{s.tag}>"


def _callout(s: Callout) -> str:
    out = [f'<div class="verdict {LEVEL_CLASS.get(s.level or "", "ok")}"><div class="line">{_e(s.text)}</div>']
    if s.note:
        out.append(f'<div class="why">{_e(s.note)}</div>')
    if s.bullets:
        out.append("<ul>" + "".join(f"<li>{_e(b)}</li>" for b in s.bullets) + "</ul>")
    return "".join(out) + "</div>"


def _section_html(s) -> str:
    if isinstance(s, Text):
        return _text(s)
    if isinstance(s, Table):
        return _table(s)
    if isinstance(s, KeyValue):
        return _kv(s)
    if isinstance(s, Block):
        if not s.body:
            return ""
        inner = (f"<h2>{_e(s.title)}</h2>" if s.title else "") + "".join(_section_html(b) for b in s.body)
        return f"<{s.tag}{_attrs(s.css, s.anchor)}>{inner}</{s.tag}>" if s.tag else inner
    if isinstance(s, Fold):
        return f"<details><summary>{_e(s.summary)}</summary>" + "".join(_section_html(b) for b in s.body) \
            + "</details>"
    if isinstance(s, Callout):
        return _callout(s)
    if isinstance(s, Bullets):
        return "<ul>" + "".join(f"<li>{_inline(c) if isinstance(c, Cell) else _e(c)}</li>" for c in s.items) + "</ul>"
    if isinstance(s, Heatmaps):
        return _heatmaps(s)
    if isinstance(s, Heatmap):
        return _heatmap(s)
    return ""


HEAD = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">']
VIEWPORT = '<meta name="viewport" content="width=device-width, initial-scale=1">'


def render_report_html(report: Report) -> str:
    """A Report (report/model.py) as one self-contained HTML page: title, verdict, every HTML section in
    order, the environment; inline CSS, no script, no link leaves the file. A `page` report's sections
    are the whole page."""
    if report.page:
        return "\n".join([*HEAD, VIEWPORT, f"<title>{_e(report.title)}</title><style>{CSS}</style></head><body>",
                          *[_section_html(s) for s in report.sections if "html" in s.media], "</body></html>"])
    worst = next((c.level for c in report.verdict if LEVEL_CLASS.get(c.level or "") == "bad"), None)
    box = LEVEL_CLASS.get(worst or (report.verdict[0].level if report.verdict else "") or "", "ok")
    parts = [*HEAD, f"<title>{_e(report.title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{_e(report.title)}</h1>",
             f'<div class="sub">{_e(report.tool)} · exit code {report.exit_code}</div>',
             f'<section id="verdict"><h2>Verdict</h2><div class="verdict {box or "ok"}">'
             + "".join(f'<div class="line">{_e(c.text)}</div>' for c in report.verdict) + "</div></section>"]
    parts += [_section_html(s) for s in report.sections if "html" in s.media]
    env = report.environment_lines()
    if env:
        parts.append('<h2>Environment</h2><div class="env">' + "".join(f"<div>{_e(x)}</div>" for x in env) + "</div>")
    parts.append(f"<footer>{_e(report.schema)} · generated by {_e(report.tool)}</footer></body></html>")
    return "\n".join(parts)
