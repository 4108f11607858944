"""The probe's HTML page and Markdown issue summary as sections (`tpprobe probe`, `tpprobe report`).

Every fact the page shows is computed here from the report document: the verdict boxes, coverage,
the capture point × rank table with its legend and hover text, the all-reduce audit (a reduce that never
ran gets its row where it should have run), the per-token heatmaps (one log scale for every point; the
all-green ones folded), the aux slots (first when a slot fault is the first failure), settings and
environment; and the summary that fits an issue in 59 lines. report/html.py and report/markdown.py lay
them out.
"""
from __future__ import annotations

import math
from typing import Optional

from ..capture.points import place_layer
from ..report.words import (audit_text, cell_label, coverage_parts, coverage_text, missing_allreduces,
                            slot_fault_first, slot_holds, slot_values_differ, timing_text, verdict_items)
from ..report.model import (FILES, Block, Bullets, Callout, Cell, Column, Fold, Heatmap, Heatmaps, KeyValue, Row,
                            Table, Text)

HTML, MARKDOWN = ("html",), ("markdown",)
LEVEL_LEGEND = [("reference", "reference", "the rank the others are compared to"),
                ("bitwise", "bitwise", "identical bits"),
                ("noise", "noise", "differs within the dtype's rounding (reduction order)"),
                ("material", "material", "differs beyond rounding: a bug"),
                ("shape", "shape", "shapes or dtypes differ"),
                ("own share", "share", "a rank's own shard before the all-reduce: not compared")]
# an all-reduce complete within rounding is a healthy reduce: shown like an exact one, never as noise
AUDIT_LEVEL = {"noise": "exact"}
AUDIT_LABEL = {"noise": "complete (within rounding)", "exact": "complete (exact)"}
QUIET = ("bitwise", "share", "exact")
MAX_LINES = 59
MAX_VERDICT = 8


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def cell_title(s: dict) -> str:
    """A cell's hover text: its numbers."""
    keys = ("max_abs", "mean_abs", "rel_diff", "ulp_max", "first_token", "bad_fraction", "nan_mismatch",
            "dtype", "shape")
    return "; ".join(f"{k}={_fmt(s[k])}" for k in keys if k in s and s[k] is not None)


def page_title(st: dict, sep: str = " —") -> str:
    """The page's title (the Markdown summary's heading has `sep` ":")."""
    return (f"tpprobe rank-diff{sep} {st.get('model')} · tp={int(st.get('world_size') or 1)} · {st.get('backend')} · "
            f"{st.get('dtype')} · ids {st.get('aux ids') or st.get('layer_ids')}")


# ---- HTML --------------------------------------------------------------------------------------
def _verdict(doc: dict) -> Block:
    body = []
    for f in verdict_items(doc):
        sev = f.get("severity")
        body.append(Callout(f["line"], sev if sev in ("failure", "warning", "info") else "ok",
                            f"why: {f['explain']}" if sev not in ("info", "ok") and f.get("explain") else None,
                            [f"follows from it: {c}" for c in f.get("consequences") or []]))
    return Block("verdict", "Verdict", body)


def _coverage(doc: dict) -> Block:
    rows = [(what, Cell(text, "failure") if bad else text) for what, text, bad in coverage_parts(doc)]
    return Block("coverage", "Coverage", [KeyValue(None, rows, css="coverage")] if rows else [])


def _env_header(doc: dict) -> Block:
    from ..report.envinfo import env_lines
    return Block("env-header", None, [Text(x, tag="div") for x in env_lines(doc)], tag="div", css="env")


def _points(doc: dict, world: int) -> Block:
    missing = set(doc.get("ranks_missing") or [])
    legend = Text(parts=[Cell(k, lv, hint=v) for k, lv, v in LEVEL_LEGEND], tag="div", css="legend")
    rows = []
    for p in doc.get("points", []):
        row = [p["name"], "" if p.get("layer") is None else str(p["layer"])]
        for r in range(world):
            s = p.get("per_rank", {}).get(str(r))
            row.append(Cell(cell_label(s), s.get("level", "?"), hint=cell_title(s)) if s else
                       Cell("missing" if r in missing else "—", style="dim"))
        rows.append(row)
    cols = [Column("capture point"), Column("layer")] + [Column(f"rank {r}") for r in range(world)]
    return Block("points", "Capture points × ranks", [legend, Table(None, cols, rows, css="points")])


def _where_layer(where) -> int:
    """The layer of an audit place: "embed" is -1, "layer.K" is K, any other after every layer."""
    k = place_layer(where)
    return k if k is not None else 1 << 30


def _audit_cell(s: Optional[dict]):
    if not s:
        return Cell("—", style="dim")
    rel = s.get("rel_diff")
    txt = s.get("level", "?") + (f" {rel:.2g}" if isinstance(rel, (int, float)) and rel else "")
    return Cell(txt, AUDIT_LEVEL.get(s.get("level"), s.get("level")), hint=cell_title(s))


def _allreduce(doc: dict, world: int) -> Block:
    ar = doc.get("allreduce") or {}
    if not ar:
        return Block("allreduce", "All-reduce audit", [Text("no all-reduce recorded", tag="p")])
    missing = missing_allreduces(doc)
    body: list = [Text(audit_text(ar, missing), tag="p")]
    recs = list(ar.get("records") or [])
    for m in missing:     # the reduce that never ran gets its row where it should have run
        at = next((i for i, rec in enumerate(recs) if _where_layer(rec.get("where")) >= _where_layer(m["where"])),
                  len(recs))
        recs.insert(at, {"where": m["where"], "module": m["module"], "level": "missing", "missing_ranks": m["ranks"]})
    rows: list = []
    for rec in recs:
        lv = rec.get("level", "?")
        if lv == "missing":
            rows.append(Row(["—", str(rec["where"]), str(rec["module"]), "—", "—", Cell("never issued", "failure")]
                            + [Cell("not issued", "failure") if r in rec["missing_ranks"] else "—"
                               for r in range(world)], css="missing"))
            continue
        rows.append([str(rec.get("seq")), str(rec.get("where")), str(rec.get("module")), str(rec.get("shape")),
                     str(rec.get("group_size")), Cell(AUDIT_LABEL.get(lv, lv), AUDIT_LEVEL.get(lv, lv))]
                    + [_audit_cell((rec.get("per_rank") or {}).get(str(r))) for r in range(world)])
    if rows:
        cols = [Column(c) for c in ("seq", "where", "module", "shape", "group", "level")]
        body.append(Table(None, cols + [Column(f"rank {r}") for r in range(world)], rows, css="allreduce"))
    return Block("allreduce", "All-reduce audit", body)


def heat_values(point: dict, world: int) -> Optional[list]:
    """ranks × tokens of max |diff| vs the reference rank (None where not compared), or None."""
    rows = {int(r): s.get("heat") for r, s in point.get("per_rank", {}).items() if s.get("heat")}
    if not rows:
        return None
    n = max(len(h) for h in rows.values())
    m: list = [[None] * n for _ in range(world)]
    ref = point.get("reference_rank")
    if ref is not None and 0 <= int(ref) < world:
        m[int(ref)] = [0.0] * n
    for r, h in rows.items():
        if 0 <= r < world:
            m[r][:len(h)] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in h]
    return m


def _max(m: list) -> float:
    vals = [v for row in m for v in row if v is not None]
    return max(vals) if vals else math.nan


def _heatmaps(doc: dict, world: int) -> Block:
    intro = Text("Max |difference| to the reference rank per token (columns) and rank (rows), on one log colour "
                 "scale for all points. Green: bitwise equal; grey: not compared (reference-free shares, missing "
                 "ranks). A divergence confined to some tokens (say, those of one vocab shard) shows as columns.",
                 tag="p", css="sub")
    mats = [(p, m) for p in doc.get("points", []) for m in [heat_values(p, world)] if m is not None]
    finite = [_max(m) for _, m in mats if any(v is not None and math.isfinite(v) for row in m for v in row)]
    vmax = max(finite + [1e-6])
    missing = tuple(doc.get("ranks_missing") or [])
    tokens = doc.get("settings", {}).get("tokens")

    def one(p: dict, m: list) -> Heatmap:
        n, ref = len(m[0]), p.get("reference_rank")
        label = "token" if tokens is None or tokens == n else f"token bin ({tokens} tokens → {n} bins, max per bin)"
        levels = [["n/a" if v is None else "bitwise" if v == 0 else None for v in row] for row in m]
        return Heatmap(p["name"], [f"rank {r}" + (" (ref)" if r == ref else " (missing)" if r in missing else "")
                                   for r in range(world)], n, m, levels, vmax, xlabel=label,
                       chart=f"{p['name']}: max |x − x_ref| per token",
                       note=f"({p.get('level', '?')}, max {float(_max(m)):.3g})")

    def nonzero(m: list) -> bool:
        return any(v for row in m for v in row if v is not None)

    differ = [one(p, m) for p, m in mats if nonzero(m)]
    same = [(p, m) for p, m in mats if not nonzero(m)]
    grid = Heatmaps(differ, [one(p, m) for p, m in same],
                    f"{len(same)} capture point(s) bitwise equal on every rank: "
                    f"{', '.join(p['name'] for p, _ in same)}",
                    "every compared capture point is bitwise equal on every rank" if mats else
                    "no per-token differences recorded (no rank was compared)")
    return Block("heatmaps", "Where ranks differ: per-token heatmaps", [intro, grid])


def _slots(doc: dict) -> Block:
    rows = []
    for s in doc.get("slots") or []:
        differ = slot_values_differ(doc, s)
        rows.append([str(s.get("slot")), str(s.get("id")), str(s.get("expected")),
                     Cell(slot_holds(s), "ok" if s.get("ok") and not differ else "failure"),
                     Cell(f"differ on ranks {differ}" if differ else "agree", "failure" if differ else "ok")])
    cols = [Column(c) for c in ("slot", "id", "expected", "holds", "values across ranks")]
    return Block("slots", "Aux slots (what the draft model receives)",
                 [Table(None, cols, rows, css="slots")] if rows else [])


def _kv(d: dict, css: str) -> KeyValue:
    """The known entries of `d` (a value not recorded, None, is left out rather than shown as `None`)."""
    return KeyValue(None, [(str(k), _fmt(v) if not isinstance(v, (list, dict)) else str(v))
                           for k, v in d.items() if k not in ("gpus", "topology") and v is not None],
                    css=css, bare=True)


def _settings_env(doc: dict) -> Block:
    st = dict(doc.get("settings") or {})
    settings: list = [_kv(st, "settings")]
    tm = timing_text(doc)
    if tm:
        settings.append(Text(tm, tag="p"))
    env = doc.get("environment") or {}
    body: list = [_kv(env, "environment")]
    gpus = env.get("gpus") or []
    if gpus:
        cols = ["rank", "index", "name", "memory_gib", "pci", "uuid"]
        body += [Text("GPUs", tag="h3"), Table(None, [Column(c) for c in cols],
                                               [[str(g.get(c, "")) for c in cols] for g in gpus], css="gpus",
                                               bare=True)]
    topo = env.get("topology")
    if topo and topo.get("matrix"):
        rk = topo["ranks"]
        body += [Text(parts=[Cell("Topology between the ranks' GPUs (NVML; NV"), Cell("k", style="italic"),
                             Cell(" = k NVLinks, else the PCIe path)")], tag="h3"),
                 Table(None, [Column("")] + [Column(f"rank {r}") for r in rk],
                       [[f"rank {r}"] + [str(c) for c in row] for r, row in zip(rk, topo["matrix"])], css="topo",
                       bare=True, row_headers=True)]
        p2p = [p for p in topo.get("pairs", []) if p.get("p2p_read")]
        if p2p:
            body.append(Text("P2P read: " + "; ".join(f"{a}-{b} {p['p2p_read']}" for p in p2p
                                                      for a, b in [p["ranks"]]), tag="p"))
    return Block(tag="", body=[Block("settings", "Settings", settings), Block("environment", "Environment", body)])


def html_sections(doc: dict) -> list:
    """The probe's HTML page, top to bottom: heading, verdict, coverage, environment header, the tables in
    the order that explains the verdict (a slot fault's slot table first), settings, environment."""
    st = doc.get("settings") or {}
    world = int(st.get("world_size") or 1)
    sub = [Cell(f"{doc.get('tool', 'tpprobe')} · exit code {doc.get('exit_code', '?')}")]
    if doc.get("out"):
        sub += [Cell(" · captures: "), Cell(str(doc["out"]), style="code")]
    tables = [_points(doc, world), _allreduce(doc, world), _heatmaps(doc, world)]
    slots = _slots(doc)
    body = [slots, *tables] if slot_fault_first(doc) else [*tables, slots]
    from ..report.drafter import drafter_sections
    out = [Text(page_title(st), tag="h1"), Text(parts=sub, tag="div", css="sub"), _verdict(doc), _coverage(doc),
           *drafter_sections(doc, HTML), _env_header(doc), *body, _settings_env(doc),
           Text(f"{doc.get('schema', '')} · generated by {doc.get('tool', 'tpprobe')}", tag="footer")]
    for s in out:
        s.media = HTML
    return out


# ---- Markdown: an issue's summary, under 60 lines ----------------------------------------------------
def markdown_sections(doc: dict) -> list:
    """The verdict first, the table keeps every capture point that is not bitwise on every rank plus as many
    of the others as fit, and the rest is one line each; MAX_LINES lines in all."""
    from ..report.envinfo import env_lines
    st = doc.get("settings") or {}
    world = int(st.get("world_size") or 1)
    head = [Text(page_title(st, ":"), tag="h3")]
    items = verdict_items(doc)
    bullets = [Cell(f["line"], f.get("severity"), "code") for f in items[:MAX_VERDICT]]
    if len(items) > MAX_VERDICT:
        bullets.append(Cell(f"… {len(items) - MAX_VERDICT} more findings in report.json"))
    verdict: list = [Text("Verdict", heading=True), Bullets(bullets)]
    cov = coverage_text(doc)
    if cov:
        verdict.append(Text(f"Coverage: {cov}.", tag="p"))
    ar = doc.get("allreduce") or {}
    tail: list = []
    if ar:
        tail.append(Text(f"All-reduce audit: {audit_text(ar, missing_allreduces(doc))}.", tag="div"))
    slots = doc.get("slots") or []
    if slots:
        bad = [s for s in slots if not s.get("ok")]
        tail.append(Text(f"Aux slots: {len(slots) - len(bad)}/{len(slots)} hold the expected layer"
                         + ("; " + "; ".join(f"slot {s['slot']} holds {slot_holds(s)} (expected {s['expected']})"
                                             for s in bad[:3]) if bad else "")
                         + "".join(f"; slot {s['slot']}'s values differ on ranks {d}"
                                   for s in slots for d in [slot_values_differ(doc, s)] if d) + ".", tag="div"))
    env = doc.get("environment") or {}
    lines = [*env_lines(doc)] + ([env["platform"]] if env.get("platform") else [])
    lines.append(f"settings: tokens={st.get('tokens')} hidden={st.get('hidden')} layers={st.get('num_layers')} "
                 f"seed={st.get('seed')} exchange={st.get('exchange')} "
                 f"inject={','.join(st.get('inject') or []) or '-'}")
    tail += [Fold("Environment", [Bullets(lines)]),
             Text(f"{doc.get('tool', 'tpprobe')} · exit code {doc.get('exit_code', '?')}", tag="sub")]
    # the lines around the table: head 2, verdict 2 + bullets + 1 (+ 2 coverage), tail (+ 1 each for the
    # audit and slot lines) 3 + the environment's + 4
    used = 2 + 3 + len(bullets) + (2 if cov else 0) + (1 if ar else 0) + (1 if slots else 0) + 3 + len(lines) + 4
    from ..report.drafter import drafter_sections
    drafter = drafter_sections(doc, MARKDOWN)
    table = _md_points(doc, world, MAX_LINES - used - 5 - len(drafter))
    out = head + verdict + drafter + [table] + tail
    for s in out:
        s.media = MARKDOWN
    return out


def _md_points(doc: dict, world: int, budget: int):
    """The capture points that are not bitwise on every rank, one row each (as many as fit); the quiet
    ones (bitwise, own shares) folded into one line that names them."""
    points = doc.get("points") or []
    missing = set(doc.get("ranks_missing") or [])
    interesting = [p for p in points if p.get("level") not in QUIET]
    keep = set(id(p) for p in interesting[:max(budget, 0)])
    if not keep:
        return Text(_folded_caption(points, keep) if points else "No capture points recorded.", tag="p")
    rows = []
    for p in points:
        if id(p) not in keep:
            continue
        row = [Cell(p["name"], style="code")]
        for r in range(world):
            s = (p.get("per_rank") or {}).get(str(r))
            row.append(Cell(cell_label(s), s.get("level")) if s else ("missing" if r in missing else "—"))
        rows.append(row)
    caption = _folded_caption(points, keep) if len(points) > len(keep) else None
    return Table(None, [Column("capture point")] + [Column(f"rank {r}") for r in range(world)], rows,
                 caption=caption, media=FILES)


def _folded_caption(points: list, keep: set, names: int = 40) -> str:
    """`12 more capture points, all bitwise or own shares: `a`, `b`, ...: see the HTML report or report.json`."""
    rest = [p for p in points if id(p) not in keep]
    quiet = all(p.get("level") in QUIET for p in rest)
    shown = ", ".join(f"`{p['name']}`" for p in rest[:names]) + (", …" if len(rest) > names else "")
    more = "more " if keep else ""
    return (f"{len(rest)} {more}capture points{', all bitwise or own shares' if quiet else ''}: {shown} "
            f"(see the HTML report or report.json)")
