"""Dumper records compared through tpprobe's one noise rule (tpprobe/core/noise.py).

Its fast path `fast_level()` decides bitwise equality (a memcmp) and proves rounding noise from the
bits in chunks of token rows (same dtype; every element finite, of one sign and within ulp_bound
representable steps; rel_norm and the worst row below their bounds with a rounding margin);
anything it cannot show is judged by `compare()` itself, over chunks of token rows (its tensor
scale then is the chunk's RMS).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from ..core.noise import INT_VIEW, coarser, compare, fast_level, has_nonfinite, nonzero_rows   # THE noise rule

COMPARE_CHUNK = 1 << 20   # elements per compare() call on the slow path
LEVEL_ORDER = ["reference", "share", "bitwise", "noise", "material", "shape"]


# ---- numbers (through the one noise rule) --------------------------------------------------------
def flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1)


def measure(x: torch.Tensor, ref: torch.Tensor, judge: Optional[torch.dtype] = None) -> dict:
    """x against ref: level bitwise / noise / material / shape, max_abs, rel_diff, ulp_max."""
    if tuple(x.shape) != tuple(ref.shape):
        return {"level": "shape", "shape": list(x.shape), "ref_shape": list(ref.shape)}
    if not (x.dtype.is_floating_point and ref.dtype.is_floating_point):
        if x.dtype == ref.dtype and torch.equal(x, ref):
            return {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0}
        n = int((x.reshape(-1) != ref.reshape(-1).to(x.dtype)).sum()) if x.numel() else 0
        return {"level": "material", "max_abs": None, "rel_diff": None, "differing": n,
                "first_token": _first_row(x != ref.to(x.dtype))}
    if judge is None or judge == x.dtype:
        fast = fast_level(x, ref)      # bitwise, or noise proved from the bits; None: compare() decides
        if fast is not None:
            return fast
    return _compare_chunked(x, ref, judge)


def _first_row(mask: torch.Tensor) -> Optional[int]:
    rows = mask.reshape(mask.shape[0], -1).any(-1) if mask.dim() >= 1 and mask.shape[0] else mask.reshape(1, -1).any(-1)
    nz = rows.nonzero()
    return int(nz[0, 0]) if nz.numel() else None


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 1 and t.shape[0] > 0 else t.reshape(1, -1)


def _compare_chunked(x: torch.Tensor, ref: torch.Tensor, judge) -> dict:
    """compare() over chunks of token rows, aggregated (memory: a few chunks, not the tensor)."""
    a2, b2 = _rows2d(x), _rows2d(ref)
    rows, cols = a2.shape
    step = max(1, COMPARE_CHUNK // max(cols, 1))
    judge = judge or coarser(x.dtype, ref.dtype)
    lv, first, max_abs, mean_sum, ulp_max, bad, nanm = "bitwise", None, 0.0, 0.0, 0.0, 0.0, 0
    sxx = syy = sxy = 0.0
    for i in range(0, rows, step):
        xc, rc = a2[i:i + step], b2[i:i + step]
        c = compare(xc, rc, dtype=judge)
        k = xc.numel()
        if LEVEL_ORDER.index(c["level"]) > LEVEL_ORDER.index(lv):
            lv = c["level"]
        if first is None and c.get("first_token") is not None:
            first = i + c["first_token"]
        max_abs = max(max_abs, c.get("max_abs", 0.0))
        mean_sum += c.get("mean_abs", 0.0) * k
        ulp_max = max(ulp_max, c.get("ulp_max", 0.0))
        bad += c.get("bad_fraction", 0.0) * k
        nanm += c.get("nan_mismatch", 0)
        if c["level"] != "bitwise":
            xd, rd = xc.double(), rc.double()
            fin = torch.isfinite(xd) & torch.isfinite(rd)
            xd, rd = torch.where(fin, xd, 0.0), torch.where(fin, rd, 0.0)
            sxx += float((xd * xd).sum())
            syy += float((rd * rd).sum())
            sxy += float((xd * rd).sum())
        else:
            s = float((rc.double() ** 2).sum())
            sxx, syy, sxy = sxx + s, syy + s, sxy + s
    n = max(x.numel(), 1)
    rel = 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy))
    return {"level": lv, "max_abs": max_abs, "mean_abs": mean_sum / n, "rel_diff": rel, "ulp_max": ulp_max,
            "bad_fraction": bad / n, "first_token": first, "nan_mismatch": nanm, "by": "compare()"}


def bitwise(x: torch.Tensor, ref: torch.Tensor) -> bool:
    if x.shape != ref.shape or x.dtype != ref.dtype:
        return False
    if x.dtype in INT_VIEW:
        it = INT_VIEW[x.dtype][0]
        return torch.equal(flat(x).view(it), flat(ref).view(it))
    return torch.equal(x, ref)


def nonfinite_count(t: torch.Tensor) -> int:
    if not has_nonfinite(t):       # from the bits, in chunks
        return 0
    return int((~torch.isfinite(t)).sum())


def rows_nonzero(t: torch.Tensor, tdim: int = 0) -> torch.Tensor:
    t = t.movedim(tdim, 0) if tdim and t.dim() > tdim else t
    return nonzero_rows(t)


@contextmanager
def one_thread():
    """torch on one thread for the passes over the records: each is memory-bound and short (a chunk of
    rows), and on a busy machine intra-op threads wait on each other (bench/dumper_vs_comparator.py
    on the 2-core dev box under load: diff 9.7 s with 2 threads, 2.2 s with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
