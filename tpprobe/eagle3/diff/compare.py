"""The numbers of one slot pair (rel diff², abs, cosine, ULP; judged by THE noise rule in
core/noise.py) and the thresholds a slot pair is held to."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...core.noise import RESHARDED, coarser, compare
from ...core.errors import UsageError
from .load import Side

FINE = (torch.float32, torch.float64)
DEFAULT_THRESHOLD = {"fine": 1e-5, "coarse": 2e-3}   # rel diff: fp32 both sides / any bf16 or fp16 side


# ---- numbers ---------------------------------------------------------------------------------
def _common(x: torch.Tensor, y: torch.Tensor):
    """Both sides in the coarser float dtype (the finer side rounded), as the matcher sees them."""
    if x.dtype != y.dtype and x.dtype.is_floating_point and y.dtype.is_floating_point:
        lo = coarser(x.dtype, y.dtype)
        return x.to(lo), y.to(lo)
    return x, y


def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2Σxy/(Σx²+Σy²) in float64 (0: equal; 1: orthogonal; 2: opposite)."""
    if x.shape != y.shape:
        return math.inf
    x, y = _common(x, y)
    a, b = x.double(), y.double()
    sxx, syy = float((a * a).sum()), float((b * b).sum())
    if not (math.isfinite(sxx) and math.isfinite(syy)):
        return math.inf
    return 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * float((a * b).sum()) / (sxx + syy))


def _stats(x: torch.Tensor, y: torch.Tensor, judge: Optional[torch.dtype] = None) -> dict:
    c = compare(x, y, dtype=judge, context=RESHARDED)   # training vs serving: another run, maybe another TP
    if c["level"] == "shape":
        return {"level": "shape", "shape": c["shape"], "ref_shape": c["ref_shape"], "rel_diff": math.inf}
    a, b = x.double().reshape(x.shape[0], -1), y.double().reshape(y.shape[0], -1)
    both = torch.isfinite(a) & torch.isfinite(b)
    a0, b0 = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    den = math.sqrt(float((a0 * a0).sum()) * float((b0 * b0).sum()))
    per_tok = (a0 - b0).abs().amax(-1)
    worst = int(per_tok.argmax()) if per_tok.numel() and float(per_tok.max()) > 0 else None
    return {"level": c["level"], "rel_diff": c["rel_diff"], "max_abs": c["max_abs"], "mean_abs": c["mean_abs"],
            "cosine": float((a0 * b0).sum()) / den if den > 0
            else (1.0 if float(a0.abs().sum() + b0.abs().sum()) == 0 else 0.0),
            "ulp_max": c["ulp_max"], "ulp_mean": c["ulp_mean"], "worst_token": worst,
            "first_material_token": c["first_token"], "nan_mismatch": c["nan_mismatch"],
            "judged_in": str(judge or coarser(x.dtype, y.dtype)).replace("torch.", "")}


def pair_stats(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Target slot x against baseline slot y. Mixed precision: the main numbers are taken after
    rounding the finer side to the coarser dtype; `as_stored` keeps the unrounded comparison."""
    if x.dtype != y.dtype and x.dtype.is_floating_point and y.dtype.is_floating_point:
        lo = coarser(x.dtype, y.dtype)
        s = _stats(*_common(x, y))
        s["rounded_to"] = str(lo).replace("torch.", "")
        s["as_stored"] = _stats(x, y, judge=lo)
        return s
    return _stats(x, y)


# ---- thresholds ------------------------------------------------------------------------------
def default_threshold(b: Side, t: Side) -> float:
    return DEFAULT_THRESHOLD["fine" if b.dtype in FINE and t.dtype in FINE else "coarse"]


def parse_thresholds(text: Optional[str], n_slots: int, default: float) -> list[float]:
    """'1e-3' (every slot) or '0=1e-3,2=5e-2' (per target slot; a bare value sets the rest)."""
    out: dict[int, float] = {}
    if text:
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            k, eq, v = item.rpartition("=")
            try:
                val = float(v)
                if not math.isfinite(val) or val < 0:
                    raise ValueError
            except ValueError:
                raise UsageError(f"--threshold {text!r}: {v!r} is not a non-negative number; use 1e-3 or 0=1e-3,2=5e-2")
            if not eq:
                default = val
                continue
            try:
                j = int(k)
            except ValueError:
                raise UsageError(f"--threshold {text!r}: {k!r} is not a slot index; use 0=1e-3,2=5e-2")
            if not 0 <= j < n_slots:
                raise UsageError(f"--threshold {text!r}: slot {j} does not exist (the target has {n_slots} slots)")
            out[j] = val
    return [out.get(j, default) for j in range(n_slots)]

