"""The diff report (run_diff's dict) as a terminal table or as JSON; reads the dict only."""
from __future__ import annotations

import json
import math

import torch

from ...capture.points import point_short


def _f(x, fmt=".2e") -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    return format(x, fmt)


def print_table(rep: dict, console) -> None:
    from rich.table import Table
    from rich.text import Text
    for res in rep["results"]:
        console.print(Text(f"baseline: {res['baseline_text']}", style="dim"))
        console.print(Text(f"target:   {res['target_text']}", style="dim"))
        console.print(Text(f"tokens:   {res['alignment']['mode']}: {res['alignment']['note']}", style="dim"))
        mixed = any("as_stored" in r for r in res["rows"])
        tab = Table(pad_edge=False)
        for col in ["t→b", "target", "baseline", "rel diff²"] + (["as stored"] if mixed else []) + \
                   ["abs max/mean", "cosine", "ULP max/mean", "worst", "thr", ""]:
            tab.add_column(col, justify="left" if col in ("target", "baseline", "") else "right", no_wrap=True)
        for r in res["rows"]:
            status = ("match" if r["in_place"] else f"= b{r['baseline_slot']}") if r["matched"] else "NO MATCH"
            style = "green" if r["in_place"] else ("yellow" if r["matched"] else "bold red")
            tab.add_row(f"{r['target_slot']}→{'–' if r['baseline_slot'] is None else r['baseline_slot']}",
                        point_short(r["target_holds"]) if r["target_holds"] else "?",
                        point_short(r["baseline_holds"]) if r["baseline_holds"] else "?",
                        _f(r.get("rel_diff"), ".1e"),
                        *([_f(r["as_stored"]["rel_diff"], ".1e") if "as_stored" in r else ""] if mixed else []),
                        f"{_f(r.get('max_abs'), '.2g')}/{_f(r.get('mean_abs'), '.2g')}", _f(r.get("cosine"), ".5f"),
                        f"{_f(r.get('ulp_max'), '.3g')}/{_f(r.get('ulp_mean'), '.2g')}",
                        "–" if r.get("worst_token") is None
                        else str(r["worst_token"] + res["alignment"]["target_start"]),
                        _f(r["threshold"], ".0e"), Text(status, style=style))
        console.print(tab)
        if mixed:
            lo = next(r["rounded_to"] for r in res["rows"] if "rounded_to" in r)
            console.print(Text(f"mixed precision: rel diff² after rounding the finer side to {lo}; "
                               f"'as stored' compares the unrounded values", style="dim"))
        if res["alignment"].get("note", "").endswith("not checked"):
            console.print(Text(f"note: {res['alignment']['note']}", style="yellow"))
        console.print(Text(res["verdict"], style="bold green" if res["ok"] else "bold red"), soft_wrap=True)
        if res.get("cause"):
            c = res["cause"]
            console.print(Text(f"cause ({c['kind']}, {c['where']}): {c['detail']}", style="red"), soft_wrap=True)


def to_json(rep: dict) -> str:
    return json.dumps(_clean(rep), indent=1, default=_jsonable, allow_nan=False) + "\n"


def _clean(x):
    """JSON has no inf/NaN: non-finite numbers become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _jsonable(x):
    if isinstance(x, float):
        return None
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return str(x)
