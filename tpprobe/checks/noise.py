"""Numbers for one comparison of two tensors: bitwise / rounding noise / material.

Noise is judged element by element against the dtype's spacing: an element may differ by at most
`NOISE_ULP[dtype]` units in the last place of the larger magnitude, plus the same number of ULP of
the tensor's RMS (so elements near zero, where one ULP is tiny, are judged on the tensor's scale).
Reduction-order differences of a few ULP pass; a partial sum, a wrong shard or one corrupted
element does not. rel diff is 1 - 2Σxy/(Σx²+Σy²), computed in float64.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# generous for rounding that propagates through a few layers, far below any real fault
NOISE_ULP = {torch.float32: 64.0, torch.float64: 64.0, torch.bfloat16: 16.0, torch.float16: 32.0}
HEAT_BINS = 256


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def dtype_from_str(s: str) -> torch.dtype:
    d = getattr(torch, str(s).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {s!r}")
    return d


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if eps_of(a) >= eps_of(b) else b


def bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.is_floating_point:
        it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return torch.equal(x.contiguous().view(it), y.contiguous().view(it))
    return torch.equal(x, y)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 1 and t.shape[0] > 0 else t.reshape(1, -1)


def heat(per_token: torch.Tensor, bins: int = HEAT_BINS) -> list[float]:
    """Per-token values reduced to at most `bins` bins by max (for heatmaps)."""
    n = per_token.numel()
    if n <= bins:
        return [float(v) for v in per_token]
    edges = torch.linspace(0, n, bins + 1).long()
    return [float(per_token[edges[i]:max(edges[i + 1], edges[i] + 1)].max()) for i in range(bins)]


def compare(x: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None) -> dict:
    """Stats of x against ref. dtype: the precision the noise bound is judged in (default: the
    coarser of the two)."""
    if tuple(x.shape) != tuple(ref.shape):
        return {"level": "shape", "shape": list(x.shape), "ref_shape": list(ref.shape)}
    if bitwise_equal(x, ref):
        return {"level": "bitwise", "max_abs": 0.0, "mean_abs": 0.0, "rel_diff": 0.0, "ulp_max": 0.0,
                "ulp_mean": 0.0, "first_token": None, "bad_fraction": 0.0,
                "heat": [0.0] * min(max(x.shape[0] if x.dim() else 1, 1), HEAT_BINS), "nan_mismatch": 0}
    dtype = dtype or coarser(x.dtype, ref.dtype)
    eps = eps_of(dtype) or 1.0
    a, b = _rows(x.double()), _rows(ref.double())
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    # non-finite positions must match exactly (same NaN/Inf pattern), else the element is material
    nan_mismatch = int((fa != fb).sum()) + int(((~fa) & (~fb) & (a != b) & ~(a.isnan() & b.isnan())).sum())
    a0, b0 = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    d = (a0 - b0).abs()
    sxy, sxx, syy = float((a0 * b0).sum()), float((a0 * a0).sum()), float((b0 * b0).sum())
    rel = 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy))
    mag = torch.maximum(a0.abs(), b0.abs())
    rms = math.sqrt(syy / max(int(both.sum()), 1))
    spacing = eps * (mag + rms)             # one "ULP" at the element's scale (or the tensor's)
    ulp = torch.where(spacing > 0, d / spacing.clamp_min(1e-300), torch.zeros_like(d))
    bound = NOISE_ULP.get(dtype, 64.0)
    bad = (ulp > bound) | ((fa != fb) | ((~fa) & (~fb) & (a != b) & ~(a.isnan() & b.isnan())))
    bad_tok = bad.any(-1)
    first = int(bad_tok.nonzero()[0, 0]) if bool(bad_tok.any()) else None
    level = "material" if first is not None else "noise"
    return {"level": level, "max_abs": float(d.max()) if d.numel() else 0.0,
            "mean_abs": float(d.mean()) if d.numel() else 0.0, "rel_diff": rel,
            "ulp_max": float(ulp.max()) if ulp.numel() else 0.0,
            "ulp_mean": float(ulp.mean()) if ulp.numel() else 0.0,
            "first_token": first, "bad_fraction": float(bad.float().mean()) if bad.numel() else 0.0,
            "heat": heat(d.amax(-1) if d.numel() else torch.zeros(1)), "nan_mismatch": nan_mismatch}


def within_noise(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[dict]:
    """The common case, cheaply: {"level": "bitwise"|"noise", max_abs, rel_diff} when every element
    is within the noise bound of compare(); None when not (then call compare() for the details)."""
    if tuple(x.shape) != tuple(ref.shape):
        return None
    if bitwise_equal(x, ref):
        return {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0}
    # float32 is exact enough for a bound of many ULP of a <= fp32 dtype, and half the traffic
    acc = torch.float32 if eps_of(dtype) >= eps_of(torch.float32) else torch.float64
    a, b = x.to(acc), ref.to(acc)
    d = (a - b).abs()
    if not bool(torch.isfinite(d).all()):
        return None
    syy = float(torch.linalg.vector_norm(b, dtype=torch.float64) ** 2)
    rms = math.sqrt(syy / max(b.numel(), 1))
    eps = eps_of(dtype) or 1.0
    if bool((d > NOISE_ULP.get(dtype, 64.0) * eps * (torch.maximum(a.abs(), b.abs()) + rms)).any()):
        return None
    sxx = float(torch.linalg.vector_norm(a, dtype=torch.float64) ** 2)
    sxy = float(torch.dot(a.reshape(-1).double(), b.reshape(-1).double())) if acc == torch.float64 else \
        float((a * b).sum(dtype=torch.float64))
    rel = 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy))
    return {"level": "noise", "max_abs": float(d.max()) if d.numel() else 0.0, "rel_diff": rel}


def nonfinite(t: torch.Tensor) -> dict:
    if not t.dtype.is_floating_point:
        return {"nan": 0, "inf": 0, "first_token": None}
    nan, inf = t.isnan(), t.isinf()
    bad = _rows(nan | inf).any(-1)
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
    return {"nan": int(nan.sum()), "inf": int(inf.sum()), "first_token": first}


def nonzero_rows(t: torch.Tensor) -> torch.Tensor:
    return _rows(t).ne(0).any(-1)
