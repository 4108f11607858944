"""Every configuration against the reference, row by row (tpprobe invariance's comparison).

`runs[tp]` holds the rank documents of one TP size (tp<N>/rank<r>.json). A row's output is compared
on rank 0 with the reference configuration; a collective's input on each rank with the same TP size
(at the reference's batch), since inputs are rank shards. The cells, each configuration's worst
level and first break, the settings and the verdict make the report.
"""
from __future__ import annotations

from typing import Optional

from .levels import FP_K, FP_SEED, SCHEMA, level, worst as worst_cell
from .options import cname
from .verdict import first_break, model_name, verdict as grid_verdict


def merge_order(lists: list[list[str]]) -> list[str]:
    """Keys of every configuration in one model order (each list is in firing order)."""
    merged: list[str] = []
    for keys in sorted(lists, key=len, reverse=True):   # stable: equal lengths keep the callers' order
        prev = None
        for k in keys:
            if k not in merged:
                merged.insert(merged.index(prev) + 1 if prev is not None else 0, k)
            prev = k
    return merged


def compare(runs: dict[int, list[dict]], opts) -> dict:
    from .. import __version__
    R = opts.ref
    bidx = {b: i for i, b in enumerate(opts.batch)}

    def rows_of(c, rank=0) -> dict:
        return {r["key"]: r for r in runs[c[0]][rank]["configs"][bidx[c[1]]]["rows"]}

    rows = {c: [rows_of(c, r) for r in range(c[0])] for c in opts.configs}
    # the largest TP size first: its collectives fire inside the modules, tp 1's outputs after them
    order = merge_order([[r["key"] for r in runs[c[0]][0]["configs"][bidx[c[1]]]["rows"]]
                          for c in sorted(opts.configs, key=lambda c: -c[0])])
    table = []
    for key in order:
        any_row = next(rs[0][key] for rs in rows.values() if key in rs[0])
        is_coll = any_row["kind"] == "collective"
        ops = {c: rows[c][0][key].get("op") for c in opts.configs if key in rows[c][0]}
        entry = {"key": key, "kind": any_row["kind"], "layer": any_row.get("layer"),
                 "site": any_row.get("site"), "ops": {cname(c): o for c, o in ops.items()},
                 "bytes": {cname(c): rows[c][0][key].get("bytes") for c in opts.configs if key in rows[c][0]},
                 "cells": {}, "in_cells": {} if is_coll else None}
        for c in opts.configs:
            entry["cells"][cname(c)] = _out_cell(c, R, key, rows)
            if is_coll:
                entry["in_cells"][cname(c)] = _in_cell(c, R, key, rows)
        ref_row = rows[R][0].get(key) or any_row
        entry["dtype"] = ((ref_row.get("out") or {}).get("fp") or {}).get("dtype")
        table.append(entry)
    for c in opts.configs:
        if c != R:
            _propagated(table, cname(c), cname(R))
    configs = []
    for c in opts.configs:
        cells = [e["cells"][cname(c)] for e in table]
        cells += [e["in_cells"][cname(c)] for e in table
                  if e["in_cells"] and e["in_cells"][cname(c)].get("vs") == cname(R)]
        worst = "reference" if c == R else worst_cell(cells)["level"]
        doc = runs[c[0]][0]["configs"][bidx[c[1]]]
        configs.append({"name": cname(c), "tp": c[0], "batch": c[1], "level": worst, "lens": doc["lens"],
                        "prompt_index": doc["prompt_index"], "prompt_rows": doc["prompt_rows"],
                        "forward_s": doc["forward_s"],
                        "first_break": None if c == R else first_break(c, R, table, rows, opts)})
    ok_levels = ("bitwise",) if opts.expect == "bitwise" else ("bitwise", "noise")
    failing = [x for x in configs if x["level"] not in ok_levels and x["level"] != "reference"]
    n_rows = len(table)
    first = runs[max(runs)][0]
    settings = {**{f"model {k}" if k in ("model", "backend") else k: v for k, v in first["info"].items()},
                "model": model_name(opts), "backend": first["backend"], "device": first["device"],
                "dtype": first["dtype"], "arch": first["arch"], "tokens": first["tokens"], "hidden": first["hidden"],
                "layout": first["layout"], "tp": opts.tp, "batch": opts.batch, "reference": cname(R),
                "expect": opts.expect, "reduce": opts.reduce, "switch_above": opts.switch_above,
                "seed": opts.probe.seed, "fingerprint": {"seed": FP_SEED, "k": FP_K}}
    verdict = grid_verdict(configs, R, n_rows, opts, failing)
    from ..report.envinfo import environment
    return {"schema": SCHEMA, "tool": f"tpprobe {__version__}", "settings": settings,
            "environment": environment(), "configs": configs, "rows": table, "verdict": verdict,
            "exit_code": 1 if failing or n_rows == 0 else 0}


def _out_cell(c, R, key, rows) -> dict:
    if c == R:
        return {"level": "reference"}
    ref = rows[R][0].get(key)
    mine = [rs.get(key) for rs in rows[c]]
    if ref is None:
        if mine[0] is None:
            return {"level": "n/a", "why": "not in this configuration"}
        return {"level": "n/a", "why": f"not in the reference {cname(R)}"}
    if mine[0] is None:
        return {"level": "missing", "why": f"{cname(R)} has it, this configuration does not"}
    per_rank = [level(m["out"] if m else None, ref["out"]) for m in mine]
    cell = dict(worst_cell(per_rank))
    bad = [r for r, x in enumerate(per_rank) if x["level"] != "bitwise"]
    if bad and len(mine) > 1:
        cell["ranks"] = bad
    return cell


def _propagated(table: list[dict], n: str, rname: str) -> None:
    """Downstream of the first break, rounding differences propagate and add up: a cell whose sketch
    difference exceeds the probe's noise bound for one operation (core/noise.py rel_bound, as
    fingerprint.levels.fp_level judges a sketch) but stays within that bound * (layers since the first
    break + 1) -- each layer re-rounds and passes on what it got (measured: fp32, 6 layers, tp 4:
    2.4x the one-operation bound five layers on) -- is rounding noise that propagated, not a new
    break. A jump beyond it (a missing shard: ~0.5; a 1 % error in float32) stays material. The
    first break itself is always judged by the one-operation bound.
    Cells against the reference count from the first break against the reference; collective
    inputs compared with the same TP size at the reference's batch count from the first difference
    either way."""
    from ..core.noise import dtype_from_str, rel_bound
    last_layer = max((e["layer"] for e in table if e.get("layer") is not None), default=0)

    def cells_of(e):
        out = [("ref", e["cells"][n])]
        if e["in_cells"]:
            ic = e["in_cells"][n]
            out.append(("ref" if ic.get("vs") == rname else "sib", ic))
        return out
    first: dict[str, Optional[int]] = {"ref": None, "sib": None}
    for e in table:
        layer = e["layer"] if e.get("layer") is not None else (0 if first["ref"] is None else last_layer)
        for side, cell in cells_of(e):
            start = first["ref"] if side == "ref" else min((x for x in first.values() if x is not None), default=None)
            if start is None:
                if cell["level"] not in ("bitwise", "n/a", "reference"):
                    first[side] = layer
                continue
            if cell["level"] != "material" or cell.get("rel") is None or not e.get("dtype"):
                continue
            dt = dtype_from_str(e["dtype"])
            bound = rel_bound(dt) * (max(layer - start, 0) + 1)
            if cell["rel"] <= bound:
                cell.update(level="noise", propagated=True, bound=bound)


def _in_cell(c, R, key, rows) -> dict:
    """A collective's input on each rank: against the same rank of the reference when the TP size is
    the reference's, else against the same TP size at the reference's batch (its own sibling)."""
    vs = R if c[0] == R[0] else (c[0], R[1])
    if c == vs:
        return {"level": "reference" if c == R else "n/a",
                "why": "" if c == R else f"inputs are rank shards: no counterpart at tp {R[0]}"}
    if vs not in rows:
        return {"level": "n/a", "why": f"{cname(vs)} was not run"}
    per_rank = []
    for r in range(c[0]):
        a, b = rows[c][r].get(key), rows[vs][r].get(key)
        if a is None or b is None or a.get("in") is None or b.get("in") is None:
            return {"level": "n/a", "why": "no collective input here", "vs": cname(vs)}
        per_rank.append(level(a["in"], b["in"]))
    cell = dict(worst_cell(per_rank), vs=cname(vs))
    bad = [r for r, x in enumerate(per_rank) if x["level"] != "bitwise"]
    if bad:
        cell["ranks"] = bad
    return cell
