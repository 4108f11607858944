"""Token alignment: which baseline tokens line up with which target tokens (by input_ids: exact,
prefix, or a stated --offset); different sequences are refused."""
from __future__ import annotations

from typing import Optional

import torch

from ...core.errors import CaptureError, UsageError
from .load import Side


# ---- token alignment -------------------------------------------------------------------------
def align(b: Side, t: Side, offset: Optional[int]) -> dict:
    """Token ranges to compare: baseline[b0:b0+n] against target[t0:t0+n].
    offset: target token i is baseline token i + offset (negative: the target starts earlier)."""
    nb, nt = int(b.packed.shape[0]), int(t.packed.shape[0])
    b0, t0 = (offset, 0) if (offset or 0) >= 0 else (0, -offset)
    b0, t0 = (b0 or 0), (t0 or 0)
    n = min(nb - b0, nt - t0)
    if n <= 0:
        raise UsageError(f"--offset {offset} leaves no common tokens (baseline {nb}, target {nt})")
    if b.input_ids is None or t.input_ids is None:
        side = b if b.input_ids is None else t
        if offset is None and nb != nt:
            raise UsageError(f"{side.path} has no input_ids and the token counts differ (baseline {nb}, target "
                             f"{nt}): pass --offset N to say how they line up")
        return {"mode": "offset" if offset else "position", "offset": offset or 0, "tokens": n,
                "baseline_start": b0, "target_start": t0,
                "note": f"{side.role} has no input_ids: tokens aligned by position, not checked"}
    bi, ti = b.input_ids.reshape(-1).long(), t.input_ids.reshape(-1).long()
    if bi.numel() != nb or ti.numel() != nt:
        s = b if bi.numel() != nb else t
        raise CaptureError(f"{s.path}: {s.input_ids.numel()} input_ids but {s.packed.shape[0]} token rows")
    a, c = bi[b0:b0 + n], ti[t0:t0 + n]
    diff = (a != c).nonzero()
    if diff.numel():
        k = int(diff[0, 0])
        hint = "" if offset is not None else _offset_hint(bi, ti)
        raise UsageError(f"the token sequences differ: baseline token {b0 + k} is id {int(a[k])}, target token "
                         f"{t0 + k} is id {int(c[k])} (first difference of {n} compared{hint}); "
                         f"refusing to compare different sequences")
    mode = "offset" if offset else ("exact" if nb == nt else "prefix")
    note = {"exact": f"input_ids identical ({n} tokens)",
            "prefix": f"{'target' if nt < nb else 'baseline'} is a prefix of the "
                      f"{'baseline' if nt < nb else 'target'}: the first {n} tokens compared",
            "offset": f"target token i = baseline token i{offset or 0:+d}: {n} tokens compared"}[mode]
    return {"mode": mode, "offset": offset or 0, "tokens": n, "baseline_start": b0, "target_start": t0, "note": note}


def _offset_hint(bi, ti) -> str:
    short, long_, sign = (ti, bi, 1) if ti.numel() <= bi.numel() else (bi, ti, -1)
    m = min(short.numel(), 8)
    for off in range(1, long_.numel() - m + 1):
        if torch.equal(long_[off:off + m], short[:m]) and torch.equal(
                long_[off:off + short.numel()], short[:long_.numel() - off]):
            return f"; the target's ids appear at baseline offset {sign * off}: pass --offset {sign * off}"
    return ""

