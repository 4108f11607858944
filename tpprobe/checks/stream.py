"""Root cause on the residual stream: the first capture point in model order that differs, and why
(non-finite values, a skipped or sub-group all-reduce, an unreduced row-parallel output, a
replicated parameter that differs, or plain divergence)."""
from __future__ import annotations

from collections import Counter

import torch

from ..capture.points import point_label, point_layer, stream_order
from .crossrank import classes
from .findings import Finding
from .params import param_divergence


def diagnose_stream(ev, records, live, world, point_stats, ar, dtype, references) -> list[Finding]:
    order = stream_order(point_stats)
    bad = lambda n: [r for r, s in point_stats[n].items() if s["level"] in ("material", "shape")]  # noqa: E731
    # non-finite first: NaN spreads through every later reduce
    for n in order + [x for x in point_stats if x not in order and not x.startswith("aux")]:
        nf = [r for r, s in point_stats[n].items() if s.get("nan") or s.get("inf")]
        if nf:
            s = point_stats[n][nf[0]]
            return [Finding("non-finite", n, nf, detail=f"{s['nan']} NaN and {s['inf']} Inf values on "
                                                          f"rank{'s' if len(nf) > 1 else ''} {', '.join(map(str, nf))}")]
    # replicated parameters that differ across ranks (stale or wrong copy)
    pf = param_divergence(records, live)
    first = next((n for n in order if bad(n)), None)
    if first is None:
        return pf
    layer = point_layer(first)
    all_r = {"all_ranks": True}
    if first == "embed.out":
        if not any(a["where"] == "embed" for r in live for a in records[r].meta.get("allreduces", [])):
            rows = torch.stack([ev.rows_nonzero("embed.out", r) for r in live])
            single = float((rows.sum(0) == 1).float().mean())
            evid = {"rows_nonzero_on_one_rank": single, **all_r}
            if references and "embed.out" in references:
                evid["sum_over_ranks_vs_reference"] = ev.sum_vs("embed.out", live, references["embed.out"])
            return [Finding("partial-allreduce", "embedding (" + _embed_module(records, live) + ")", list(live),
                            detail=f"embedding output is each rank's partial sum: no all-reduce ran in the "
                                   f"embedding; {single:.0%} of token rows are non-zero on exactly one rank"
                                   + (f"; the sum over ranks matches the reference ({evid['sum_over_ranks_vs_reference']})"
                                      if "sum_over_ranks_vs_reference" in evid else ""),
                            evidence=evid)]
    # an all-reduce over a sub-group in this layer
    sub = [a for a in ar.get("records", []) if a.get("group_size", world) < world
           and (a["where"] == f"layer.{layer}" or layer == -1 and a["where"] == "embed")]
    if sub:
        groups = classes(ev, first, [r for r in live if r in point_stats[first]])
        a = sub[0]
        return [Finding("subgroup-allreduce", f"layer {layer} ({a.get('source') or a['module']})", list(live),
                        detail=f"all-reduce #{a['seq']} summed over {a['group_size']} of {world} ranks; "
                               f"ranks agree within {groups} and differ across them",
                        evidence={"groups": groups, **all_r})]
    # a row-parallel output in this layer that no all-reduce consumed
    unreduced = [u for r in live for u in records[r].meta.get("unreduced_rows", []) if u["layer"] == layer]
    if unreduced:
        mod = unreduced[0]["module"]
        ranks = sorted({r for r in live for u in records[r].meta.get("unreduced_rows", []) if u["module"] == mod})
        n_here = Counter(a["where"] for a in records[live[0]].meta.get("allreduces", []))
        typical = Counter(n for w, n in n_here.items() if w.startswith("layer.")).most_common(1)
        others = f" (other layers: {typical[0][0]})" if typical else ""
        return [Finding("partial-allreduce", f"layer {layer} ({mod})", ranks,
                        detail=f"{mod} output was never all-reduced: {n_here.get(f'layer.{layer}', 0)} all-reduce(s) "
                               f"ran in layer {layer}{others}; from here on the stream holds each rank's partial sum",
                        evidence={"unreduced": unreduced, **({"all_ranks": True} if len(ranks) == world else {})})]
    if pf:
        return pf
    groups = classes(ev, first, [r for r in live if r in point_stats[first]])
    odd = sorted(r for g in groups[1:] for r in g) if len(groups) > 1 else bad(first)
    s = point_stats[first][odd[0]] if odd and odd[0] in point_stats[first] else {}
    return [Finding("rank-divergence", first, odd,
                    detail=f"{point_label(first)} differs materially on rank{'s' if len(odd) > 1 else ''} "
                           f"{', '.join(map(str, odd))} (max abs diff {s.get('max_abs', 0):.3g}, rel diff "
                           f"{s.get('rel_diff', 0):.3g}, first token {s.get('first_token')})",
                    evidence={"groups": groups})]


def _embed_module(records, live) -> str:
    return records[live[0]].meta.get("embed_module") or "VocabParallelEmbedding"
