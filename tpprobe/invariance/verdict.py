"""Where bitwise equality first breaks in one configuration, what breaks it, and the verdict over
the grid (tpprobe invariance).

The first row in model order that is not bitwise names the cause:
* collective-size: a collective whose inputs are bitwise equal on every rank to the same TP size at
  the reference's batch while its output is not (the collective depends on its message size);
* tp-split: a collective's output at another TP size (the split reduction adds in another order);
* compute: anything else (the computation between the last bitwise row and this one).
"""
from __future__ import annotations

from typing import Optional

from .levels import RANK, human_bytes, level
from .options import cname


def _coll(row: Optional[dict]) -> Optional[dict]:
    if not row or row.get("kind") != "collective":
        return None
    return {k: row.get(k) for k in ("op", "site", "module", "layer", "seq", "shape", "dtype", "bytes")}


def _coll_text(col: Optional[dict]) -> str:
    if not col or not col.get("op"):
        return "no collective (tp 1)"
    shape = "×".join(map(str, col.get("shape") or []))
    return f"{col['op']} of {human_bytes(col.get('bytes'))} ({shape} {col.get('dtype')})"


def first_break(c, R, table, rows, opts) -> Optional[dict]:
    prev = None
    for e in table:
        cell = e["cells"][cname(c)]
        inc = e["in_cells"][cname(c)] if e["in_cells"] else None
        if inc and inc.get("vs") == cname(R) and inc["level"] not in ("bitwise", "n/a", "reference"):
            return _blame_compute(c, R, e, inc, prev, rows, where="input")
        if cell["level"] in ("bitwise", "n/a", "reference"):
            if cell["level"] == "bitwise":
                prev = e
            continue
        if e["kind"] == "collective":
            return _blame_collective(c, R, e, cell, prev, rows, opts)
        return _blame_compute(c, R, e, cell, prev, rows, where="point")
    return None


def _label(e: Optional[dict]) -> str:
    if e is None:
        return "the input ids"
    return f"{e['key']} ({'collective output' if e['kind'] == 'collective' else 'capture point'})"


def _brk(c, e, cell, cause, summary, col=None, ref_col=None, vs=None) -> dict:
    """summary: what breaks, in words that hold for every configuration it breaks the same way;
    line: the same for this configuration, with its level and message size."""
    lvl = cell["level"] + (f" (rel {cell['rel']:.1e})" if cell.get("rel") is not None else "")
    size = f"; {_coll_text(col)}" + (f", {_coll_text(ref_col)} in {vs}" if ref_col and ref_col.get("op") else "") \
        if col else ""
    return {"row": e["key"], "kind": e["kind"], "layer": e.get("layer"), "level": cell["level"],
            "rel": cell.get("rel"), "ranks": cell.get("ranks"), "cause": cause, "collective": col,
            "compared_collective": ref_col, "vs": vs, "summary": summary,
            "line": f"{cname(c)}: {summary}: {lvl}{size}."}


def _where(e) -> str:
    return f"layer {e['layer']}" if e.get("layer") is not None else "outside the decoder layers"


def _blame_collective(c, R, e, cell, prev, rows, opts) -> dict:
    key = e["key"]
    mine, ref = rows[c][0].get(key), rows[R][0].get(key)
    col = _coll(mine)
    # the same TP size at the reference's batch: equal inputs on every rank, unequal output = the collective
    sib = R if c[0] == R[0] else (c[0], R[1])
    if sib != c and sib in rows and key in rows[sib][0]:
        inputs_equal = all(
            rows[c][r].get(key) and rows[sib][r].get(key) and rows[c][r][key].get("in") and rows[sib][r][key].get("in")
            and level(rows[c][r][key]["in"], rows[sib][r][key]["in"])["level"] == "bitwise" for r in range(c[0]))
        out_differs = level(mine["out"], rows[sib][0][key]["out"])["level"] != "bitwise"
        if inputs_equal and out_differs:
            sc = _coll(rows[sib][0][key])
            switched = bool(sc and col and sc.get("op") != col.get("op"))
            summary = (f"bitwise equality breaks at the collective of {e['site']} ({_where(e)}): its inputs are "
                       f"bitwise equal on every rank to the same TP size at batch {sib[1]}, its output is not, so the "
                       f"collective's result depends on its message size"
                       + (" (it switched algorithm)" if switched else ""))
            return _brk(c, e, cell, "collective-size", summary, col, sc, cname(sib))
    if c[0] != R[0]:
        rc = _coll(ref)
        summary = (f"bitwise equality breaks at the collective of {e['site']} ({_where(e)}): the TP-split reduction "
                   f"(a partial sum per rank shard, then the collective) adds in another order than {cname(R)}"
                   + ("" if rc and rc.get("op") else " (no collective there: the contraction is not split)"))
        return _brk(c, e, cell, "tp-split", summary, col, rc, cname(R))
    summary = (f"bitwise equality breaks at the output of {e['site']} ({_where(e)}): its collective's inputs "
               f"already differ, so the computation between {_label(prev)} and it does")
    return _brk(c, e, cell, "compute", summary, col, _coll(ref), cname(R))


def _blame_compute(c, R, e, cell, prev, rows, where) -> dict:
    what = f"the input of the collective of {e['site']}" if where == "input" else e["key"]
    summary = (f"bitwise equality breaks at {what} ({_where(e)}) while {_label(prev)} is still bitwise: the "
               f"computation in between (no collective) depends on the batch or the TP size")
    col = _coll(rows[c][0].get(e["key"])) if e["kind"] == "collective" else None
    return _brk(c, e, cell, "compute", summary, col, None, cname(R))


def verdict(configs, R, n_rows, opts, failing) -> dict:
    others = [x for x in configs if x["level"] != "reference"]
    if n_rows == 0:
        return {"status": "empty", "line": "NOTHING COMPARED: no capture point or collective was recorded", "lines": []}
    levels = {x["level"] for x in others}
    n_bit = sum(x["level"] == "bitwise" for x in others)
    grid = f"tp {','.join(map(str, opts.tp))} × batch {','.join(map(str, opts.batch))}"
    if levels == {"bitwise"}:
        head = (f"BITWISE: all {len(others)} configurations ({grid}) are bitwise equal to {cname(R)} "
                f"at every one of the {n_rows} capture points and collectives")
        status = "bitwise"
    else:
        worst = max(levels, key=lambda lv: RANK.get(lv, 0))
        word = {"noise": "within rounding noise", "material": "MATERIALLY", "shape": "in SHAPE",
                "missing": "in COVERAGE (rows missing)"}.get(worst, worst)
        head = (f"NOT BITWISE: {len(others) - n_bit} of {len(others)} configurations ({grid}) differ from "
                f"{cname(R)}, worst {word}")
        status = worst
    groups: dict[str, list] = {}          # configurations that break the same way: one line
    for x in others:
        if x["first_break"]:
            groups.setdefault(x["first_break"]["summary"], []).append(x)
    lines = []
    for summary, xs in groups.items():
        per = []
        for x in xs:
            fb = x["first_break"]
            lv = fb["level"] + (f" {fb['rel']:.1e}" if fb.get("rel") is not None else "")
            col = fb.get("collective")
            per.append(f"{x['name']} {lv}" + (f", {col['op']} {human_bytes(col.get('bytes'))}"
                                              if col and col.get("op") else ""))
            cc = fb.get("compared_collective")
            if fb["cause"] == "collective-size" and cc and cc.get("op"):
                per[-1] += f" (vs {cc['op']} {human_bytes(cc.get('bytes'))} in {fb['vs']})"
        lines.append(f"{', '.join(x['name'] for x in xs)}: {summary} [{'; '.join(per)}]")
    exp = (f"--expect {opts.expect}: " + ("met" if not failing else
                                          f"NOT met by {', '.join(x['name'] for x in failing)}"))
    return {"status": status, "line": head, "lines": lines, "expect": exp}


def model_name(opts) -> str:
    from ..engines.registry import engine_of
    engine = engine_of(opts.probe)
    if not engine.builtin_shapes:
        return engine.model_label(opts.probe)
    return "builtin" + (f" (reduce {opts.reduce}" + (f", switch above {opts.switch_above} B" if opts.switch_above
                                                     is not None else "") + ")" if opts.reduce != "default" else "")
