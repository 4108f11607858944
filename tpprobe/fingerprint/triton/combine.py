"""A batch's partials into fingerprints: the device combine's call and the host combine (same bits).

A forward's partials are reduced on the device (``kernels.combine_kernel``, one program per tensor)
into one small result buffer, so the host copies ~(6 + k) words and a token bitmap per tensor instead
of every program's partials, and only formats.  The float sums run over the programs IN ORDER
(acc = ((0.0 + p0) + p1) + ... + p_{n-1}, float64), which is how the host combine (``combine_many``,
used by a CUDA-graph tap's read and TPPROBE_FP_HOST_COMBINE=1) sums them too."""
from __future__ import annotations

import math

import numpy as np
import torch
import triton

from .. import definition as fpdef
from .kernels import combine_kernel


def combine_call(desc, base, out, m: int, k: int, kp_max: int):
    """(kernel, grid, args, kwargs) of the device combine of m items: desc their [m, DESC]
    descriptors (a device int64 tensor), base the int64 buffer their indices count from, out the
    result buffer (int64)."""
    return (combine_kernel, (m,),
            (desc, base, base.view(torch.float32), base.view(torch.int32), out, out.view(torch.float64),
             out.view(torch.int32), k),
            dict(CB=combine_cb(kp_max), UNROLL=16, RB=64, FB=1024, num_warps=1))


def combine_cb(kp_max: int) -> int:
    """The device combine's column block for items of at most kp_max sketch columns per row."""
    return triton.next_power_of_2(kp_max + 2)


def combine_one(p: dict, hi, hf, hflag, seed: int, k: int, rows_extra=None, tensor=None) -> fpdef.Fingerprint:
    """The host combine of one tensor's partials at plan p's offsets (``combine_many`` of one)."""
    return combine_many(p, hi, hf, hflag, [p["ioff"]], [p["foff"]], [p["toff"]], seed, k,
                        rows_extra=[rows_extra], tensors=[tensor])[0]


def combine_many(p: dict, hi, hf, hflag, ioffs, foffs, toffs, seed: int, k: int, rows_extra=None,
                 tensors=None) -> list:
    """The host combine (exact integers, float64) of m tensors of one plan (same shape and dtype)
    from the copied buffer (numpy views: int64 partials hi, float32 partials hf, int32 token flags
    hflag; item i's at ioffs[i] / foffs[i] / toffs[i] in them): one gather and a few numpy
    reductions for all m.  The float sums run over the programs in order (p0 + p1 + ..., never
    numpy's pairwise sum), as the device combine adds them, so both give the same fingerprints to
    the bit.  A 16-bit tensor with NaN / Inf gets its exact counts from tensors[i] when it is still
    there; without it (a CUDA-graph tap reads after replay) the counts say at least one."""
    kp, n = p["kp"], p["nprog"]
    io, fo = np.asarray(ioffs, dtype=np.int64), np.asarray(foffs, dtype=np.int64)
    m = len(io)
    ip = hi[io[:, None] + np.arange(n * 4)].reshape(m, n, 4)      # partials < 2^32: exact in int64
    fp = hf[fo[:, None] + np.arange(n * (kp + 2))].reshape(m, n, kp + 2).astype(np.float64)
    la = (ip[:, :, 0].sum(1) & fpdef.M32).tolist()
    lb = (np.bitwise_xor.reduce(ip[:, :, 1], axis=1) & fpdef.M32).tolist()
    nans, infs = ip[:, :, 2].sum(1).tolist(), ip[:, :, 3].sum(1).tolist()
    # in order, as the device adds: numpy reduces a middle axis row by row from 0.0 (out += row
    # i); its pairwise sum is only along the innermost axis (tests/helpers/fp_interp.py: synthetic() sees
    # a change of either)
    acc = fp[:, :, :kp + 1].sum(1)
    sk, sumsq, absmax = acc[:, :k].tolist(), acc[:, kp].tolist(), fp[:, :, kp + 1].max(1).tolist()
    if p["flags"]:
        flags = hflag[np.asarray(toffs, dtype=np.int64)[:, None] + np.arange(p["shape"][0])] > 0
        rows = [r.tobytes().hex() for r in np.packbits(flags, axis=1, bitorder="little")]
    else:
        rows = ["" if x is None else bitmap_hex(x) for x in (rows_extra or [None] * m)]
    return [make_fp(p, la[i], lb[i], nans[i], infs[i], sumsq[i], absmax[i], sk[i], rows[i],
                    tensors[i] if tensors else None, seed) for i in range(m)]


def make_fp(p: dict, la: int, lb: int, n_nan: int, n_inf: int, s: float, a: float, sketch: list, rows: str,
            t, seed: int) -> fpdef.Fingerprint:
    """One tensor's Fingerprint from its host-combined values."""
    if not (math.isfinite(s) and math.isfinite(a)):
        s, a, n_nan, n_inf = exact_nonfinite(p, s, a, n_nan, n_inf, t)
    return fpdef.Fingerprint(shape=list(p["shape"]), dtype=p["dtype_s"], bit_hash=fpdef.hash_hex(la, lb),
                             sketch=sketch, sumsq=s, absmax=a, n_nan=n_nan, n_inf=n_inf, row_nonzero=rows, seed=seed)


def exact_nonfinite(p: dict, s: float, a: float, n_nan: int, n_inf: int, t):
    """sumsq, absmax, n_nan, n_inf of a tensor whose combined sum of squares or max |x| is not
    finite: a 16-bit tensor's exact counts come from the tensor when it is still there; without
    it (a CUDA-graph tap reads after replay) the counts say at least one."""
    if p["dtype"] == torch.float32:       # the fp32 kernel counts them exactly
        return s, a, n_nan, n_inf
    if t is not None:
        return nonfinite_stats(t)
    return s, a, int(math.isnan(s)), int(math.isinf(a))


def bitmap_hex(flags) -> str:
    """``reference._bitmap_hex`` on a numpy bool array: bit r of byte r // 8, little-endian."""
    return np.packbits(flags.astype(np.uint8), bitorder="little").tobytes().hex()


def nonfinite_stats(t: torch.Tensor):
    """sumsq, absmax, n_nan, n_inf as ``reference._fingerprint_torch`` computes them."""
    x = t.detach().reshape(-1).float()
    isn = torch.isnan(x)
    n_nan = int(isn.sum())
    n_inf = int(torch.isinf(x).sum())
    absmax = float(torch.where(isn, torch.zeros_like(x), x.abs()).max())
    sumsq = float("nan") if n_nan else float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
    return sumsq, absmax, n_nan, n_inf
