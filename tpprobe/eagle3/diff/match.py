"""The slot matcher: every target slot against every baseline slot, each slot named by the residual
stream it equals, and the verdict (match, permuted, shifted, off-by-one, missing, ...)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...capture.points import point_label, point_layer, point_position, point_short
from ...checks.slots import slot_verdict
from .compare import pair_stats, rel_diff
from .load import Side


# ---- the matcher -----------------------------------------------------------------------------
def _label(p: Optional[str]) -> str:
    return point_label(p) if p else "nothing recognisable"


def identify(slots: list[torch.Tensor], streams: dict[str, torch.Tensor], thr: float) -> list[dict]:
    """Each slot's nearest residual stream (or the embedding), named when within thr."""
    out = []
    for s in slots:
        best, br = None, math.inf
        for n, c in streams.items():
            r = rel_diff(s, c)
            if r < br:
                best, br = n, r
        out.append({"point": best if br <= thr else None, "nearest": best,
                    "rel_diff": br if math.isfinite(br) else None})
    return out


def _stream_view(side: Side, sl: slice) -> dict[str, torch.Tensor]:
    return {n: t[sl] for n, t in side.streams.items()}


def diff_sides(b: Side, t: Side, al: dict, thresholds: list[float], id_thr: float) -> dict:
    bs = slice(al["baseline_start"], al["baseline_start"] + al["tokens"])
    ts = slice(al["target_start"], al["target_start"] + al["tokens"])
    B = [s[bs] for s in b.slots]
    T = [s[ts] for s in t.slots]
    nb, nt = len(B), len(T)
    M = [[rel_diff(T[j], B[i]) for i in range(nb)] for j in range(nt)]
    match: list[Optional[int]] = []
    for j in range(nt):
        if not nb:
            match.append(None)
            continue
        i = min(range(nb), key=lambda i: (M[j][i], i != j))
        if j < nb and M[j][j] <= thresholds[j]:
            i = j                                   # in place wins ties (duplicated slots)
        match.append(i if M[j][i] <= thresholds[j] else None)

    # name each slot by a residual stream: its own side's streams first, else the other side's
    streams_src = None
    tid = bid = None
    if t.streams or b.streams:
        tsrc = (_stream_view(t, ts), "target") if t.streams else (_stream_view(b, bs), "baseline")
        bsrc = (_stream_view(b, bs), "baseline") if b.streams else (_stream_view(t, ts), "target")
        tid = identify(T, tsrc[0], id_thr)
        bid = identify(B, bsrc[0], id_thr)
        streams_src = {"target": tsrc[1], "baseline": bsrc[1]}
    tp = [x["point"] for x in tid] if tid else [None] * nt
    bp = [x["point"] for x in bid] if bid else [None] * nb

    rows = []
    un_b = [i for i in range(nb) if i not in match]
    un_t = [j for j in range(nt) if match[j] is None]
    counterpart = {j: (j if j in un_b else None) for j in un_t}
    rest_b = [i for i in un_b if i not in counterpart.values()]
    for j in [j for j in un_t if counterpart[j] is None]:
        counterpart[j] = rest_b.pop(0) if rest_b else None
    for j in range(nt):
        i = match[j] if match[j] is not None else counterpart.get(j)
        if i is None and nb:
            i = min(range(nb), key=lambda i: M[j][i])
        st = pair_stats(T[j], B[i]) if i is not None else {}
        rows.append({"target_slot": j, "baseline_slot": i, "target_holds": tp[j],
                     "baseline_holds": bp[i] if i is not None else None, "matched": match[j] is not None,
                     "in_place": match[j] == j, "threshold": thresholds[j], **st})

    ok = nt == nb and all(match[j] == j for j in range(nt))
    verdict, kinds = _verdict(match, M, thresholds, tp, bp, nb, nt, ok)
    cause = None
    if not ok and bid and tid and all(bp) and all(tp):
        v = slot_verdict([point_layer(p) for p in bp], bp, tp, max(b.num_layers or 0, t.num_layers or 0) or None,
                         name_ids=False)
        if v is not None:
            cause = {"kind": v[0], "where": v[1], "detail": v[2]}
    return {"ok": ok, "verdict": verdict, "kinds": kinds, "cause": cause, "match": match,
            "rel_matrix": [[(x if math.isfinite(x) else None) for x in r] for r in M],
            "identity": {"target": tid, "baseline": bid, "streams_from": streams_src},
            "rows": rows}


def _verdict(match, M, thr, tp, bp, nb, nt, ok) -> tuple[str, list[str]]:
    def bl(i):
        return f"baseline slot {i}" + (f" ({_label(bp[i])})" if bp[i] else "")

    if ok:
        worst = max((M[j][j] for j in range(nt)), default=0.0)
        names = ", ".join(f"{j} = {point_short(tp[j] or bp[j])}" for j in range(nt)) if any(tp) or any(bp) else ""
        return (f"MATCH: all {nt} target slots equal the baseline's in place (max rel diff² {worst:.2e})"
                + (f": slots {names}" if names else ""), ["match"])
    kinds: list[str] = []
    parts: list[str] = []
    matched = [j for j in range(nt) if match[j] is not None]
    un_b = [i for i in range(nb) if i not in match]
    un_t = [j for j in range(nt) if match[j] is None]
    if nt == nb and not un_t and sorted(match) == list(range(nb)):
        kinds.append("permuted")
        parts.append("slots are permuted")
    elif matched and all(match[j] - j == match[matched[0]] - matched[0] for j in matched) \
            and match[matched[0]] != matched[0]:
        d = match[matched[0]] - matched[0]
        kinds.append("shifted")
        parts.append(f"slots are shifted by {abs(d)} position{'s' if abs(d) > 1 else ''} "
                     f"(target slot j = baseline slot j{d:+d})")
    dup = [i for i in set(m for m in match if m is not None) if match.count(i) > 1]
    if dup:
        kinds.append("duplicated")
    for j in range(nt):
        if match[j] is not None:
            if match[j] != j or (dup and match[j] in dup):
                parts.append(f"target slot {j} = {bl(match[j])}")
    pair = {}
    rest_b = list(un_b)
    for j in un_t:
        if j in rest_b:
            pair[j] = j
            rest_b.remove(j)
    for j in un_t:
        if j not in pair and rest_b:
            pair[j] = rest_b.pop(0)
    named = set()
    for j in un_t:
        e = pair.get(j)
        txt = f"target slot {j} has no match"
        if tp[j] and e is not None and tp[j] == bp[e]:
            # the same capture point on both sides, computed differently: the slot is where it belongs
            txt = (f"target slot {j} holds {_label(tp[j])}, as baseline slot {e} does, with other values (rel diff² "
                   f"{M[j][e]:.2e} > threshold {thr[j]:.0e}): the streams themselves differ, not the slot's place")
            kinds.append("values-differ")
        elif tp[j] and e is not None and bp[e]:
            txt += f": {_label(tp[j])} was captured where {_label(bp[e])} (baseline slot {e}) was expected"
            lt, lb = point_position(tp[j]), point_position(bp[e])
            if lt is not None and lb is not None and abs(lt - lb) == 1:
                txt += f", one layer {'early' if lt < lb else 'late'} (off by one)"
                kinds.append("off-by-one")
                named.add(e)
            else:
                kinds.append("wrong-layer")
        elif tp[j]:
            txt += f": it holds {_label(tp[j])}" + (f", expected {bl(e)}" if e is not None else
                                                    ", which the baseline does not carry")
            kinds.append("wrong-layer" if e is not None else "extra-slot")
        else:
            near = min(range(nb), key=lambda i: M[j][i]) if nb else None
            txt += (f" (closest: baseline slot {near}, rel diff² {M[j][near]:.2e} > threshold {thr[j]:.0e})"
                    if near is not None else "")
            if e is not None and e != near:
                txt += f"; expected {bl(e)}"
            kinds.append("no-match")
        parts.append(txt)
    for i in un_b:
        if i in pair.values():
            if bp[i] and bp[i] not in tp and i not in named:
                parts.append(f"{_label(bp[i])} is missing from the target")
                kinds.append("missing-slot")
            continue
        parts.append(f"{bl(i)} is missing from the target")
        kinds.append("missing-slot")
    if nt != nb:
        parts.append(f"the target has {nt} slots, the baseline {nb}")
        kinds.append("slot-count")
    if not kinds:
        kinds.append("mismatch")
    return "MISMATCH: " + "; ".join(parts), sorted(set(kinds), key=kinds.index)
