"""Root cause on the residual stream: the first capture point in model order that differs, and why
(non-finite values, a skipped or sub-group all-reduce, an unreduced row-parallel output, a
replicated parameter that differs, or plain divergence)."""
from __future__ import annotations

from collections import Counter

import torch

from ..capture.points import (AUX, EMBED_OUT, EMBED_PLACE, is_layer_place, layer_place, parse, point_label,
                              point_layer, stream_order)
from ..capture.schema import Coverage
from .crossrank import classes
from .findings import Finding
from .params import param_divergence


def diagnose_stream(ev, records, live, world, point_stats, ar, dtype, references) -> list[Finding]:
    order = stream_order(point_stats)
    bad = lambda n: [r for r, s in point_stats[n].items() if s["level"] in ("material", "shape")]  # noqa: E731
    # non-finite first: NaN spreads through every later reduce
    for n in order + [x for x in point_stats if x not in order and parse(x).kind != AUX]:
        nf = [r for r, s in point_stats[n].items() if s.get("nan") or s.get("inf")]
        if nf:
            s = point_stats[n][nf[0]]
            return [Finding("non-finite", n, nf,
                            detail=f"{s['nan']} NaN and {s['inf']} Inf values on "
                                   f"rank{'s' if len(nf) > 1 else ''} {', '.join(map(str, nf))}")]
    # replicated parameters that differ across ranks (stale or wrong copy)
    pf = param_divergence(records, live)
    first = next((n for n in order if bad(n)), None)
    if first is None:
        return pf
    layer = point_layer(first)
    all_r = {"all_ranks": True}
    if first == EMBED_OUT:
        if not any(a.where == EMBED_PLACE for r in live for a in records[r].meta.collectives):
            rows = torch.stack([ev.rows_nonzero(EMBED_OUT, r) for r in live])
            single = float((rows.sum(0) == 1).float().mean())
            evid = {"rows_nonzero_on_one_rank": single, **all_r,
                    "missing_allreduce": {"where": EMBED_PLACE, "module": _embed_module(records, live)}}
            if references and EMBED_OUT in references:
                evid["sum_over_ranks_vs_reference"] = ev.sum_vs(EMBED_OUT, live, references[EMBED_OUT])
            return [Finding("partial-allreduce", "embedding (" + _embed_module(records, live) + ")", list(live),
                            detail=f"embedding output is each rank's partial sum: no all-reduce ran in the "
                                   f"embedding; {single:.0%} of token rows are non-zero on exactly one rank"
                                   + (f"; the sum over ranks matches the reference "
                                      f"({evid['sum_over_ranks_vs_reference']})"
                                      if "sum_over_ranks_vs_reference" in evid else ""),
                            evidence=evid)]
    # an all-reduce over a sub-group in this layer
    # (a record the audit could not read has group_size -1: it says nothing about groups)
    sub = [a for a in ar.get("records", []) if 0 < (a.get("group_size") or world) < world
           and a["where"] == layer_place(layer)]
    if sub:
        groups = classes(ev, first, [r for r in live if r in point_stats[first]])
        a = sub[0]
        return [Finding("subgroup-allreduce", f"layer {layer} ({a.get('source') or a['module']})", list(live),
                        detail=f"all-reduce #{a['seq']} summed over {a['group_size']} of {world} ranks; "
                               f"ranks agree within {groups} and differ across them",
                        evidence={"groups": groups, **all_r})]
    # (b) the partial-sum signature in the data, from this layer alone (its input and its output)
    sig = partial_sum_signature(ev, live, world, point_stats, first, references)
    sig_text = signature_text(sig, layer)
    # a row-parallel output in this layer that no all-reduce consumed
    unreduced = [u for r in live for u in records[r].meta.unreduced_rows if u.layer == layer]
    if unreduced and not summed_as_copy(records, live, layer):
        mod = unreduced[0].module
        ranks = sorted({r for r in live for u in records[r].meta.unreduced_rows if u.module == mod})
        n_here = Counter(a.where for a in records[live[0]].meta.collectives)
        kinds = layer_kinds(records, live)
        if layer is not None and 0 <= layer < len(kinds) and len(set(kinds)) > 1:
            # a dense layer beside MoE layers: only the layers of its own kind are a measure
            same = Counter(n_here.get(layer_place(k), 0) for k in range(len(kinds))
                           if k != layer and kinds[k] == kinds[layer]).most_common(1)
            others = f" (other layers of its kind: {same[0][0]})" if same else " (no other layer of its kind)"
        else:
            typical = Counter(n for w,
                              n in n_here.items() if is_layer_place(w) and w != layer_place(layer)).most_common(1)
            others = f" (other layers: {typical[0][0]})" if typical else ""
        # the layers where the same module's output went unreduced, less those where it was summed as a copy
        # (SGLang's DP attention reduces a buffer o_proj's rows were copied into, in every layer)
        same = {u.layer for r in live for u in records[r].meta.unreduced_rows
                if u.layer is not None and _relative(u.module, _layer_name(records, live, u.layer))
                == _relative(mod, _layer_name(records, live, layer))}
        every = sorted(k for k in same if k == layer or not summed_as_copy(records, live, k))
        n_layers = _coverage(records, live).layers_found or 0
        span = (f"; the same module's output is unreduced in every layer ({len(every)} of {n_layers})"
                if n_layers > 1 and len(every) == n_layers else
                f"; also unreduced in layers {[k for k in every if k != layer]}" if len(every) > 1 else "")
        path = _path_of(records, live, mod, layer, unreadable_only=True)
        return [Finding("partial-allreduce", f"layer {layer} ({mod})", ranks,
                        detail=f"{mod} output was never all-reduced"
                               f"{' (' + path + ')' if path else ''}: {n_here.get(layer_place(layer), 0)} "
                               f"all-reduce(s) ran in layer {layer}{others}{span}; from here on the stream holds "
                               f"each rank's partial sum",
                        # the data's signature beside it, in the evidence (the line and its why keep their
                        # words: the fault table and the annotated report in docs/ are generated from them)
                        evidence={"unreduced": [u.to_json() for u in unreduced],
                                  "missing_allreduce": {"where": layer_place(layer), "module": mod},
                                  **({"partial_sum_signature": sig} if sig else {}),
                                  **({"all_ranks": True} if len(ranks) == world else {})})]
    # a reduce the audit counted in the other layers but not in this one (whatever issued it: a
    # row-parallel module, the block itself, a hook, a reduce-scatter)
    missing = missing_reduce(records, live, world, layer)
    if missing is not None:
        if sig:
            missing.detail += sig_text
            missing.evidence["partial_sum_signature"] = sig
        return [missing]
    if pf:
        return pf
    n_layer = sum(1 for a in records[live[0]].meta.reduces if a.layer == layer)
    if sig is not None and layer is not None and (len(live) >= 3 or n_layer == 0):
        # no module known row-parallel, no count to vouch (every layer, a 1-layer model): the data
        # alone show the ranks hold shares of one sum. Alone only where it cannot be a drift: at tp >= 3
        # (no two ranks agree, a drift on one rank leaves the others agreeing) or where the layer issued
        # no reduce at all; at tp 2 beside reduces that ran, a drift as large as the layer's increment
        # could look like shares, so that stays rank-divergence (its why names no weight)
        name = _layer_name(records, live, layer)
        return [Finding("partial-allreduce", f"layer {layer} ({name})", list(live),
                        detail=(f"the stream leaving layer {layer} is each rank's partial sum: a reduce in {name} "
                                f"never ran{sig_text}; the audit counted {n_layer} reduce(s) there, and no other layer "
                                f"of its kind issues more (every layer alike, "
                                f"or the only one of its kind), so only the data show it"),
                        evidence={"partial_sum_signature": sig, "missing_allreduce": {"where": layer_place(layer),
                                                                                      "module": name},
                                  "all_ranks": True})]
    groups = classes(ev, first, [r for r in live if r in point_stats[first]])
    odd = sorted(r for g in groups[1:] for r in g) if len(groups) > 1 else bad(first)
    s = point_stats[first][odd[0]] if odd and odd[0] in point_stats[first] else {}
    # no parameter differs and the audit saw every reduce complete: nothing points at a weight shard
    # (the replicated parameters that differ were named above), so the why line does not say so
    return [Finding("rank-divergence", first, odd,
                    detail=f"{point_label(first)} differs materially on rank{'s' if len(odd) > 1 else ''} "
                           f"{', '.join(map(str, odd))} ({_size_text(s)})",
                    evidence={"groups": groups, "explain": (
                        "these ranks compute something different from the others from here on, while every "
                        "replicated parameter agrees across ranks and every audited reduce returned the sum of "
                        "its inputs: a TP-sharded weight the probe cannot compare across ranks, a rank-dependent "
                        "code path, or a computation outside the audited collectives")})]


# the partial-sum signature: ranks that hold shares of one sum hold distinct
# increments (pairwise cosine measured 0.01 (GPT-J block), 0.72 (tp 2), <= 0.81 (tp 4) on the zoo
# and the built-in model); ranks that ran one computation and drifted on one rank (a nudged stream,
# a stale norm weight) hold near-copies (cosine 1.00): below SHARE_COS they are shares
SHARE_COS = 0.95


def partial_sum_signature(ev, live, world, point_stats, first, references=None) -> dict | None:
    """Positive evidence, from one layer's input and output alone, that the ranks hold partial sums
    where `first` (the first stream point that differs) was read: the layer's input agrees on every
    rank, its output differs on every rank (at tp >= 3 no two ranks agree: a stale copy on one rank
    leaves the others agreeing), and the ranks' increments over the layer are distinct shares, not
    copies of one computation (pairwise cosine < SHARE_COS). With a tp=1 reference, also whether the
    increments sum to its stream (they do when the missing reduce is the layer's last sum)."""
    order = stream_order(point_stats)
    if first not in order or order.index(first) == 0 or len(live) < 2:
        return None
    prev, k = order[order.index(first) - 1], point_layer(first)
    if k is None or (prev != EMBED_OUT if k == 0 else point_layer(prev) != k - 1):
        return None
    if any(point_stats[prev].get(r, {}).get("level") not in ("reference", "bitwise", "noise") for r in live):
        return None
    if any(point_stats[first].get(r, {}).get("level") not in ("reference", "material") for r in live):
        return None
    if len(live) >= 3 and any(len(g) > 1 for g in classes(ev, first, live)):
        return None
    inc = ev.increments(first, prev, live)
    if inc is None:
        return None
    cos = []
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            na, nb = float(torch.linalg.vector_norm(inc[a])), float(torch.linalg.vector_norm(inc[b]))
            if na == 0 or nb == 0:
                return None
            cos.append(float((inc[a] * inc[b]).sum()) / (na * nb))
    if max(cos) >= SHARE_COS:
        return None
    sig = {"input": prev, "max_cosine": round(max(cos), 4), "ranks": list(live)}
    if references and first in references:
        level = ev.increments_sum_vs(first, prev, live, references[first])
        if level is not None:
            sig["sum_vs_reference"] = level
    return sig


def signature_text(sig: dict | None, layer) -> str:
    if not sig:
        return ""
    text = (f"; the data agree: over layer {layer} (from {point_label(sig['input'])}, the same on every rank) "
            f"the ranks' increments are distinct shares of one sum, not copies (pairwise cosine at most "
            f"{sig['max_cosine']:.2f})")
    if sig.get("sum_vs_reference") in ("bitwise", "noise"):
        text += ", and they sum to the unsharded tp=1 reference's stream"
    return text


def _coverage(records, live) -> Coverage:
    """The reference rank's coverage (an older capture's: nothing said)."""
    return records[live[0]].meta.coverage or Coverage()


def _relative(module: str, prefix: str) -> str:
    return module[len(prefix):] if module == prefix or module.startswith(prefix + ".") else module


def layer_kinds(records, live) -> list:
    """Each decoder layer's kind, from its structure: the names (relative to the layer) of the
    replicated parameters it holds, so a dense layer and an MoE layer (its router) are two kinds
    and their reduce counts are compared within each kind only; one kind when nothing is known."""
    cov = _coverage(records, live)
    names = cov.layer_names
    n = cov.layers_found or len(names)
    own: dict = {k: set() for k in range(n)}
    for name, e in records[live[0]].meta.params.items():
        k = e.layer
        if isinstance(k, int) and k in own:
            own[k].add(_relative(name, names[k]) if k < len(names) else name)
    return [frozenset(own[k]) for k in range(n)]


def _typical(per_layer: list, kinds: list, layer: int) -> tuple:
    """(the typical reduce count of `layer`'s kind over the OTHER layers of that kind, how many of
    them hold it, how many there are); (0, 0, 0) when the layer is the only one of its kind."""
    same = [per_layer[k] for k in range(len(per_layer)) if k != layer and kinds[k] == kinds[layer]]
    if not same:
        return 0, 0, 0
    typical, held = Counter(same).most_common(1)[0]
    return typical, held, len(same)


def silent_missing_reduce(records, live, world) -> list[Finding]:
    """A layer that lacks a reduce every other layer of its kind issues, while the ranks still agree
    (a reduce-scatter skipped before an all-gather makes every rank hold the same wrong stream): the
    audit's count is the evidence. Only when a strict majority of the other layers of that kind
    share the typical count (a dense layer 0 beside MoE layers is judged against dense layers only:
    with none, on data alone)."""
    n = _coverage(records, live).layers_found or 0
    counts = Counter(a.layer for a in records[live[0]].meta.reduces if a.layer is not None)
    per_layer = [counts.get(k, 0) for k in range(n)]
    if not per_layer:
        return []
    kinds = layer_kinds(records, live)
    for k in range(n):
        typical, held, others = _typical(per_layer, kinds, k)
        if others < 2 or held * 2 <= others or per_layer[k] >= typical:
            continue
        f = missing_reduce(records, live, world, k)
        if f is not None:
            f.detail += " (the ranks agree with each other, so only the audit's count shows it)"
            return [f]
    return []


def summed_as_copy(records, live, layer) -> bool:
    """On every live rank, `layer` issued no fewer reduces than the other layers of its kind, and at least as many
    all-reduces the audit traced to no row-parallel output as row-parallel outputs the tap saw go unreduced:
    each such output may have been summed as a copy (SGLang's DP attention copies o_proj's rows into its
    gathered buffer and reduces that buffer), so the audit's numbers do not say it was never reduced."""
    if layer is None or layer < 0:
        return False
    n = _coverage(records, live).layers_found or 0
    if layer >= n:
        return False
    kinds = layer_kinds(records, live)
    kinds = kinds if len(kinds) == n else [frozenset()] * n
    for r in live:
        reduces = records[r].meta.reduces
        counts = Counter(a.layer for a in reduces if a.layer is not None)
        typical, _, _ = _typical([counts.get(k, 0) for k in range(n)], kinds, layer)
        if counts.get(layer, 0) < typical:
            return False
        # a reduce the audit counts but cannot read ("unknown": vLLM's CPU shm op) may be the copy's as well
        untraced = sum(1 for a in reduces if a.layer == layer and a.kind in ("all_reduce", "unknown")
                       and a.source is None)
        if untraced < sum(1 for u in records[r].meta.unreduced_rows if u.layer == layer):
            return False
    return True


def missing_reduce(records, live, world, layer) -> Finding | None:
    """Positive evidence of a skipped reduce at `layer`: the audit counted fewer reduces there than
    in the typical layer, on these ranks. Names the reduce the layer lacks (by its issuing module in
    a layer that has it) and the path it goes through."""
    if layer is None or layer < 0:
        return None
    cov = _coverage(records, live)
    names = cov.layer_names
    n_layers = cov.layers_found or (max((a.layer for a in records[live[0]].meta.reduces if a.layer is not None),
                                        default=-1) + 1)
    counts = {r: Counter(a.layer for a in records[r].meta.reduces if a.layer is not None) for r in live}
    per_layer = [counts[live[0]].get(k, 0) for k in range(n_layers)]
    if layer >= n_layers:
        return None
    # the typical count of this layer's kind, over the other layers of that kind (a dense layer is
    # never held to its MoE neighbours' count, nor an MoE layer to the dense one's)
    kinds = layer_kinds(records, live)
    kinds = kinds if len(kinds) == n_layers else [frozenset()] * n_layers
    typical, _, _ = _typical(per_layer, kinds, layer)
    short = [r for r in live if counts[r].get(layer, 0) < typical]
    if not typical or not short:
        return None
    like = [k for k in range(n_layers) if per_layer[k] == typical and k != layer and kinds[k] == kinds[layer]]
    j = min(like, key=lambda k: abs(k - layer)) if like else None
    prefix = (lambda k: names[k] if k < len(names) else f"layer {k}")
    what = "a reduce"
    module = prefix(layer)
    if j is not None:
        have = Counter((_relative(a.module, prefix(j)), a.kind, a.path or "")
                       for a in records[short[0]].meta.reduces if a.layer == j)
        mine = Counter((_relative(a.module, prefix(layer)), a.kind, a.path or "")
                       for a in records[short[0]].meta.reduces if a.layer == layer)
        lost = list((have - mine).elements())
        if lost:
            rel, kind, path = lost[0]
            module = prefix(layer) + rel if rel.startswith(".") or not rel else rel
            what = f"the {kind.replace('_', '-')} ({path})"
    n_here = counts[short[0]].get(layer, 0)
    return Finding("partial-allreduce", f"layer {layer} ({module})", short,
                   detail=(f"{what} issued by {module} never ran: the audit counted {n_here} reduce(s) in layer "
                           f"{layer} where the other layers{' of its kind' if len(set(kinds)) > 1 else ''} issue "
                           f"{typical}; from here on the stream holds each rank's partial sum"),
                   evidence={"reduces_in_layer": n_here, "typical": typical,
                             **({"all_ranks": True} if len(short) == world else {})})


def _layer_name(records, live, k) -> str:
    names = _coverage(records, live).layer_names
    return names[k] if k is not None and 0 <= k < len(names) else f"layer {k}"


def _path_of(records, live, module: str, layer, unreadable_only: bool = False) -> str:
    """The door the same module's reduce takes in another layer (what the missing one would go through);
    unreadable_only: only when that door is one the audit counts but cannot read (it is then the
    only trace of the reduce: say it)."""
    rel = _relative(module, _layer_name(records, live, layer))
    for a in records[live[0]].meta.reduces:
        k = a.layer
        if unreadable_only and a.checked:
            continue
        if k is not None and k != layer and _relative(a.source or a.module, _layer_name(records, live, k)) == rel:
            return f"its reduce goes through {a.path or 'c10d.allreduce_'} in layer {k}"
    return ""


def _size_text(s: dict) -> str:
    """How large a difference is, from full stats or from a fingerprint (no max_abs there)."""
    parts = []
    if s.get("rel_norm") is not None:
        parts.append(f"relative error {s['rel_norm']:.3g}" + (" (fingerprint estimate)"
                                                              if s.get("from") == "fingerprint" else ""))
    if s.get("max_abs") is not None:
        parts.append(f"max abs diff {s['max_abs']:.3g}")
    if s.get("ulp_max") is not None and s.get("from") != "fingerprint":
        parts.append(f"worst element {s['ulp_max']:.3g} ULP")
    if s.get("first_token") is not None:
        parts.append(f"first token {s['first_token']}")
    return ", ".join(parts) or "sizes not measured"


def _embed_module(records, live) -> str:
    return records[live[0]].meta.embed_module or "VocabParallelEmbedding"
