"""The diff report (run_diff's dict) as the shared Report (sections for every sink) and as JSON; reads the dict only."""
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


def diff_report(rep: dict):
    """The diff (run_diff's dict) as the shared Report: per rank pair, the sides, the token alignment, the
    slot table, the verdict and the cause."""
    from ...report.model import Cell, Column, Report, Table, Text
    sections: list = []
    for res in rep["results"]:
        sections += [Text(f"baseline: {res['baseline_text']}", style="dim"),
                     Text(f"target:   {res['target_text']}", style="dim"),
                     Text(f"tokens:   {res['alignment']['mode']}: {res['alignment']['note']}", style="dim")]
        mixed = any("as_stored" in r for r in res["rows"])
        cols = ["t→b", "target", "baseline", "rel diff²"] + (["as stored"] if mixed else []) + \
               ["abs max/mean", "cosine", "ULP max/mean", "worst", "thr", ""]
        rows = []
        for r in res["rows"]:
            status = ("match" if r["in_place"] else f"= b{r['baseline_slot']}") if r["matched"] else "NO MATCH"
            level = "ok" if r["in_place"] else ("warning" if r["matched"] else "failure")
            rows.append([f"{r['target_slot']}→{'–' if r['baseline_slot'] is None else r['baseline_slot']}",
                         point_short(r["target_holds"]) if r["target_holds"] else "?",
                         point_short(r["baseline_holds"]) if r["baseline_holds"] else "?",
                         _f(r.get("rel_diff"), ".1e"),
                         *([_f(r["as_stored"]["rel_diff"], ".1e") if "as_stored" in r else ""] if mixed else []),
                         f"{_f(r.get('max_abs'), '.2g')}/{_f(r.get('mean_abs'), '.2g')}", _f(r.get("cosine"), ".5f"),
                         f"{_f(r.get('ulp_max'), '.3g')}/{_f(r.get('ulp_mean'), '.2g')}",
                         "–" if r.get("worst_token") is None
                         else str(r["worst_token"] + res["alignment"]["target_start"]),
                         _f(r["threshold"], ".0e"), Cell(status, level)])
        sections.append(Table(None, [Column(c, justify="left" if c in ("target", "baseline", "") else "right",
                                            no_wrap=True) for c in cols], rows, terminal={"pad_edge": False}))
        if mixed:
            lo = next(r["rounded_to"] for r in res["rows"] if "rounded_to" in r)
            sections.append(Text(f"mixed precision: rel diff² after rounding the finer side to {lo}; "
                                 f"'as stored' compares the unrounded values", style="dim"))
        if res["alignment"].get("note", "").endswith("not checked"):
            sections.append(Text(f"note: {res['alignment']['note']}", "warning"))
        sections.append(Text(res["verdict"], "ok" if res["ok"] else "failure",
                             style="bold green" if res["ok"] else "bold red", soft_wrap=True))
        if res.get("cause"):
            c = res["cause"]
            sections.append(Text(f"cause ({c['kind']}, {c['where']}): {c['detail']}", "failure", style="red",
                                 soft_wrap=True))
    verdict = [Cell(res["verdict"], "ok" if res["ok"] else "failure") for res in rep["results"]]
    first = rep["results"][0] if rep["results"] else {}
    title = (f"tpprobe diff: {first.get('target_text', '?')} against {first.get('baseline_text', '?')}"
             if first else "tpprobe diff")
    return Report(rep["schema"], title, rep, verdict=verdict, sections=sections, exit_code=rep["exit_code"],
                  to_json=lambda d: to_json(d).rstrip("\n"))


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
