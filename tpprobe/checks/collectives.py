"""Collective sequences: every rank must issue the same all-reduces (place, shape, group) in the
same order; the first place one rank departs is the finding."""
from __future__ import annotations

from collections import Counter

from .findings import Finding


def sequence_mismatch(records: dict, live: list[int]) -> list[Finding]:
    seqs = {r: [(a.where, tuple(a.shape), a.group_size) for a in records[r].meta.collectives] for r in live}
    if len({tuple(s) for s in seqs.values()}) <= 1:
        return []
    common = Counter(tuple(s) for s in seqs.values()).most_common(1)[0][0]
    odd = [r for r in live if tuple(seqs[r]) != common]
    r0 = odd[0]
    i = next((i for i, (a, b) in enumerate(zip(seqs[r0], common)) if a != b), min(len(seqs[r0]), len(common)))
    mine = seqs[r0][i] if i < len(seqs[r0]) else None
    theirs = common[i] if i < len(common) else None
    return [Finding("collective-mismatch", (mine or theirs)[0], odd,
                    detail=f"all-reduce #{i}: rank {r0} issued {_ar_text(mine)}, the others "
                           f"{_ar_text(theirs)} ({len(seqs[r0])} vs {len(common)} all-reduces)",
                    evidence={"index": i, "counts": {r: len(s) for r, s in seqs.items()}})]


def _ar_text(a) -> str:
    if a is None:
        return "nothing"
    return f"one at {a[0]} of shape {list(a[1])} over {a[2]} ranks"


def extra_collective_place(audit: list[dict], ref_audit: list):
    """Where a stalled rank's sequence (its posted audit, JSON) first departs from the others' (the reference
    rank's collectives): the extra collective."""
    if not audit:
        return None, None
    for i, a in enumerate(audit):
        if i >= len(ref_audit) or (a["where"], a["shape"]) != (ref_audit[i].where, ref_audit[i].shape):
            return a["where"], i
    return None, None
