"""`tpprobe report DUMPDIR --emit-dims`: the dims SGLang's comparator needs, from what was measured.
"""
from __future__ import annotations

import json
import re

from .check import GroupResult, span
from ..formats.sglang_dump import tp_layout


def dims_for(g: GroupResult) -> tuple[str, str]:
    """The dims string SGLang's comparator needs for this record, and why (from what was measured)."""
    nd = len(g.shape)
    names = (["t"] + [f"d{i}" for i in range(1, nd - 1)] + ["h"]) if nd >= 2 else (["t"] if nd == 1 else [])
    lay = tp_layout(g.declared)
    if lay and lay[0] == g.read and g.read in ("partial", "sharded"):
        return g.declared, "as declared in the dump, and the ranks agree with it"
    if not names:
        return "1", "a scalar"
    if g.read == "partial":
        i = nd - 1
        names[i] += "[tp:partial]"
        why = "measured: " + ("disjoint non-zero token rows across ranks" if "rows_nonzero_on_one_rank" in g.evidence
                              and g.evidence.get("rows_nonzero_on_one_rank", 0) >= 0.9 else
                              f"Σ over ranks equals {g.evidence['sum_equals']}" if g.evidence.get("sum_equals") else
                              "declared partial" if g.evidence.get("declared") else "ranks differ everywhere "
                                                                                    "(suspected partial)")
        return " ".join(names), why
    if g.read == "sharded":
        i = g.sharded_dim if g.sharded_dim is not None else nd - 1
        names[i] += "[tp]"
        return " ".join(names), "measured: a TP slice (width × tp = hidden)" if not g.declared else "declared sharded"
    if g.tp_size <= 1:
        return " ".join(names), "tp 1: nothing to unshard"
    if g.read == "replicated":
        lv = {s.get("level") for s in g.per_rank.values()} - {"reference"}
        return " ".join(names) + " # tp:replicated", \
            f"measured: every rank {'bitwise equal' if lv <= {'bitwise'} else 'equal within rounding'}"
    return " ".join(names) + " # tp:replicated", \
        f"ranks disagree ({g.read}): replicated is what it should be; the comparator will fail it"


def emit_dims_text(data: dict) -> str:
    """A YAML file for `python -m sglang.srt.debug_utils.comparator --override-config FILE`."""
    per: dict = {}
    for g in data["_groups"]:
        if g.read == "not a tensor":
            continue
        d, why = dims_for(g)
        per.setdefault(g.name, {}).setdefault(d, (why, []))[1].append(g.step)
    lines = [f"# tpprobe --emit-dims: dims for SGLang's comparator, from what tpprobe measured on {data['path']}",
             f"# (tp {data['tp_size']}, {len(data['ranks'])} ranks, steps "
             f"{span(data['steps']) if data['steps'] else '-'})",
             "# use: python -m sglang.srt.debug_utils.comparator --override-config THIS_FILE ...",
             "overrides:"]
    for name, ds in per.items():
        pat = "^" + re.escape(name) + "$"
        if len(ds) > 1:
            lines.append(f"  # {name}: the steps disagree "
                         f"({'; '.join(f'{d} at steps {span(s)}' for d, (_, s) in ds.items())});"
                         f" the first is used")
        d, (why, steps) = next(iter(ds.items()))
        bad = [f for f in data["findings"] if f["severity"] == "failure" and f["where"].split(" (", 1)[0] == name]
        for f in bad[:1]:      # the dims say what the files hold; a fault they hold is not a layout to keep
            lines.append(f"  # {name}: `tpprobe report` names a FAILURE here ({f['kind']}): these dims describe "
                         f"the files as they are, not as they should be")
        lines.append(f"  - match: {json.dumps(pat)}   # {why}")
        lines.append(f"    dims: {json.dumps(d)}")
    return "\n".join(lines) + "\n"
