"""How two fingerprints compare: bitwise / noise / material / shape, judged by the noise model on the sketches.

The checks (checks/evidence.py), the rank's slot matching (capture/slots.py) and `tpprobe invariance`
ask this one question of two fingerprints; nothing here reads a tensor.
"""
from __future__ import annotations

import math

import torch

from ..core.noise import is_noise, ulp_of
from .reference import Fingerprint


def fp_rel(a: Fingerprint, b: Fingerprint) -> float:
    """≈ ||a - b|| / max(||a||, ||b||), from the linear sketches."""
    err = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a.sketch, b.sketch)))
    s = math.sqrt(max(a.sumsq, b.sumsq)) if not (math.isnan(a.sumsq) or math.isnan(b.sumsq)) else float("nan")
    return 0.0 if err == 0 else (err / (math.sqrt(a.k) * s) if s and not math.isnan(s) else float("inf"))


def fp_measure(a: Fingerprint, b: Fingerprint, dtype: torch.dtype) -> dict:
    """What the noise model can judge from two fingerprints: the norm-wise relative error (the
    sketch's estimate, or the exact lower bound | ||a|| - ||b|| | / max(||a||, ||b||) from the sums of
    squares when larger: a drift that scales the stream is measured exactly, not estimated) and a
    lower bound of the worst element's difference (|absmax(a) - absmax(b)|)."""
    est, exact = fp_rel(a, b), 0.0
    na, nb = math.sqrt(max(a.sumsq, 0.0)), math.sqrt(max(b.sumsq, 0.0))
    if math.isfinite(na) and math.isfinite(nb) and max(na, nb) > 0:
        exact = abs(na - nb) / max(na, nb)
    # the rule judges the two apart (noise.SKETCH_SLACK: the estimate spreads, the bound does not)
    m = {"from": "fingerprint", "rel_norm": max(est, exact), "sketch_rel": est, "norm_rel": exact,
         "nan_mismatch": int((a.n_nan, a.n_inf) != (b.n_nan, b.n_inf))}
    if dtype.is_floating_point and math.isfinite(a.absmax) and math.isfinite(b.absmax):
        spacing = float(ulp_of(torch.tensor(max(abs(a.absmax), abs(b.absmax)), dtype=torch.float64), dtype))
        m["ulp_max"] = abs(a.absmax - b.absmax) / spacing if spacing > 0 else 0.0
    return m


def fp_level(a: Fingerprint, b: Fingerprint, dtype: torch.dtype) -> str:
    """bitwise / noise / material / shape: the noise model (core/noise.py) on what fingerprints tell."""
    if a.shape != b.shape:
        return "shape"
    if a.bit_hash == b.bit_hash and a.dtype == b.dtype:
        return "bitwise"
    if (a.n_nan, a.n_inf) != (b.n_nan, b.n_inf) or a.n_nan or a.n_inf:
        return "material"
    return "noise" if is_noise(fp_measure(a, b, dtype), dtype) else "material"


def fp_dtype(fp: Fingerprint) -> torch.dtype:
    return getattr(torch, fp.dtype)
