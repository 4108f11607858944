"""A reduce that ran and returned the wrong value (F22, F23): the audit's own measurement as a finding.

The audit compares each collective's output, on every rank, with what its definition returns from
every rank's input (checks/allreduce.py). A record it calls incomplete is a failure of its own,
`allreduce-incomplete`, at its place: the layer and issuing module, the reduce number, the path it
came through, its group, the ranks whose output is wrong with their error, and what the output is
instead (a scaled sum and its factor, one rank's input, the previous call's output, zeros).

It is the root cause when it comes first in model order: a reduce inside layer k precedes the
stream leaving layer k (layer.k.out) and follows the layer's input norm (layer.k.in_norm). When
every rank got the same wrong sum the ranks agree, and the audit's pair is the only evidence; when
one rank's is wrong, that rank diverges from there on, and the divergence follows from it (it is
not a stale weight shard).
"""
from __future__ import annotations

from typing import Optional

from ..capture.points import EMBED_OUT, IN_NORM, parse, point_layer, stream_order
from .looks import looks_text
from .findings import Finding

MAX_FINDINGS = 8      # the first incomplete reduces, one finding each; the count of the rest in the last


def _layer_of(rec: dict) -> int:
    """-1 for the embedding's reduce, k inside layer k, a large number outside the layers (the head)."""
    if rec.get("where") == "embed":
        return -1
    return rec["layer"] if rec.get("layer") is not None else 1 << 30


def incomplete_records(ar: dict) -> list[dict]:
    return [e for e in ar.get("records", []) if e.get("level") == "incomplete"]


def reduce_key(rec: dict) -> tuple:
    return (_layer_of(rec), 1, rec.get("seq", 0))


def point_key(name: str) -> tuple:
    """Where a capture point sits against the reduces: layer.k.in_norm before layer k's reduces,
    layer.k.out (and the embedding's output, after its reduce) after them."""
    if name == EMBED_OUT:
        return (-1, 2, 0)
    k = point_layer(name)
    return ((k if k is not None else 1 << 30), 0 if parse(name).kind == IN_NORM else 2, 0)


def first_divergence(point_stats: dict) -> Optional[str]:
    return next((n for n in stream_order(point_stats)
                 if any(s["level"] in ("material", "shape") for s in point_stats[n].values())), None)


def _where(e: dict, records, live) -> str:
    who = e.get("source") or e.get("module") or "?"
    if e.get("where") == "embed":
        return f"embedding ({who})"
    return f"layer {e['layer']} ({who})" if e.get("layer") is not None else f"{e.get('where')} ({who})"


KIND_NAME = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
             "all_to_all": "all-to-all"}


# the kind's sentence (findings.EXPLAIN) speaks of a reduce; a data mover's says what it moved wrong
EXPLAIN_KIND = {
    "reduce_scatter": "a reduce-scatter ran and returned the wrong value: not this rank's slice of the sum (a custom "
                      "or fused reduce-scatter that read its peers' buffers before their writes landed, skipped the "
                      "sum, or took the wrong offset); the audit's own input and output of that collective show it",
    "all_gather": "an all-gather ran and returned the wrong value: a block is not what its rank sent (a peer's write "
                  "that never landed, leaving the previous call's block or zeros; blocks placed in the wrong rank "
                  "order); the audit's own input and output of that collective show it, block by block",
    "all_to_all": "an all-to-all ran and returned chunks that are not what its peers sent it (a write that never "
                  "landed, wrong split sizes or offsets); the audit's own input and output of that collective show it",
}


def _definition(kind: str, op: str) -> str:
    """What a complete collective of this kind returns, in words (with its article: "the sum",
    "its slice of the sum", "the concatenation")."""
    red = "sum" if op in ("SUM", "") else f"{op} reduction"
    return {"reduce_scatter": f"its slice of the {red}", "all_gather": "the concatenation",
            "all_to_all": "the chunks its peers sent it"}.get(kind, f"the {red}")


def incomplete_findings(ar: dict, records, live: list[int], world: int) -> list[Finding]:
    recs = incomplete_records(ar)
    out = []
    for e in recs[:MAX_FINDINGS]:
        per = e.get("per_rank") or {}
        bad = sorted(int(r) for r, p in per.items() if p["level"] == "material")
        kind = e.get("kind") or "all_reduce"
        looks = {}
        op = str(e.get("op") or "SUM")
        for r in bad:
            p = per[str(r)]
            if kind == "all_to_all":
                ws = p.get("chunks_wrong") or []
                t = (f"wrong chunks from {'rank ' + str(ws[0]) if len(ws) == 1 else 'ranks ' + str(ws)} (not what "
                     f"{'that rank' if len(ws) == 1 else 'those ranks'} sent it)") if ws else "wrong chunks"
            else:
                t = looks_text(p.get("looks"), op, kind)
            looks.setdefault(t, []).append(r)
        # each wrong rank's error relative to what a complete collective returns there (`error`: a sum
        # scaled by f is off by |f - 1|); records of older reports carry only the noise rule's rel_norm
        errs = ", ".join(f"rank {r} {per[str(r)].get('error', per[str(r)].get('rel_norm')):.3g}" for r in bad
                         if per[str(r)].get("error", per[str(r)].get("rel_norm")) is not None)
        defn = _definition(kind, op)
        what = "; ".join(f"on {'rank ' + str(rs[0]) if len(rs) == 1 else 'ranks ' + str(rs)} it returned {t}"
                         for t, rs in looks.items()) if looks else f"its output is not {defn} of its inputs"
        grp = f"group {e['group']}, " if e.get("group") else ""
        n = e.get("group_size")
        # wrong alike on every rank: comparing the ranks' outputs of this reduce cannot show it (the streams after it
        # may still differ: under SGLang's DP attention each group reads its own rows of the buffer)
        agree = (" It is wrong alike on every rank, which comparing the ranks' outputs cannot show: the audit's "
                 "input/output pair does."
                 if len(bad) == world and kind == "all_reduce" and len(looks) == 1
                 and not next(iter(looks)).startswith("not the ") else "")
        sketch = ar.get("method") == "sketch"
        if kind in ("all_gather", "all_to_all"):
            against = "against the chunks sent, bit for bit" + (" (their sketches' hashes)" if sketch else "")
            if kind == "all_gather":
                against = ("of its blocks' sketches against the sent blocks' (compared bit for bit by their hashes)"
                           if sketch else "against the exact concatenation (compared bit for bit)")
        else:
            against = (f"of its sketch against the sketch of {defn}"
                       + ({"all_reduce": " (the sum of its inputs' sketches)",
                           "reduce_scatter": " (the sum of the sketches of its inputs' slices)"}.get(kind, "")
                          if op == "SUM" else "")
                       if sketch else f"against {defn}, computed exactly")
        out.append(Finding(
            "allreduce-incomplete", _where(e, records, live), bad,
            detail=(f"{KIND_NAME.get(kind, kind)} #{e['seq']} ({e.get('path')}, {grp}{n} ranks, shape "
                    f"{e.get('shape')}) ran, but its output is not {defn}"
                    + ("" if kind == "all_to_all" else " of its inputs")
                    + f": {what}" + (f" (relative error {against}: {errs})" if errs else f" ({against})")
                    + f".{agree}"),
            evidence={"seq": e["seq"], "path": e.get("path"), "group": e.get("group"), "group_size": n,
                      "kind": kind, "op": op, "per_rank": per, "looks": {t: rs for t, rs in looks.items()},
                      **({"explain": EXPLAIN_KIND[kind]} if kind in EXPLAIN_KIND else {}),
                      **({"all_ranks": True} if len(bad) == world else {})}))
    if len(recs) > MAX_FINDINGS:
        out[-1].consequences.append(f"{len(recs) - MAX_FINDINGS} more incomplete all-reduces in report.json "
                                    f"(allreduce.records)")
    return out
