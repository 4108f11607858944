"""Fused Triton fingerprint kernels for CUDA tensors (bf16 / fp16 / fp32).

Each element is read once from device memory and everything ``fingerprint._fingerprint_torch``
computes comes out of one launch per tensor: the word hash's two lanes, the sketch, the sum of
squares, max |x| and the per-token-row non-zero flags.  Each program writes one row of partials;
a forward's partials are combined on the device (``_combine_kernel``: exact integers, float64
sums in program order, one program per tensor) and come back in ONE small device-to-host copy per
batch, which the host only formats.  The host combine (``combine_many``, the same sums in the same
order, so the same bits) serves a CUDA-graph tap's read and TPPROBE_FP_HOST_COMBINE=1.

* 16-bit tensors: ``_fp16_kernel``, everything elementwise in registers (see its docstring).
* fp32 tensors: ``_fp32_kernel``, the sketch through a tf32-free ``ieee`` dot per tile.

NaN and Inf: the 16-bit kernel counts nothing per element; a NaN makes the sum of squares NaN and
an Inf makes max |x| infinite, and only then does the host take the exact counts
(``_nonfinite_stats``).  Imported lazily (triton is optional).
"""
from __future__ import annotations

import inspect
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from ..core.cuda import current_stream
from . import definition as F
from ..config.knobs import knob_int, knob_set

_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

QA = tl.constexpr(F.QA)
SA = tl.constexpr(F.SA)
QB = tl.constexpr(F.QB)


@triton.jit
def _mix_a(x):
    # lowbias32
    x = x ^ (x >> 16)
    x = x * tl.cast(0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.cast(0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _pair(w0, w1, p):
    # the hash of word pair p: lowbias32(((w0 ^ (p*QA + SA)) + w1*QB) mod 2^32)
    k = p.to(tl.uint32) * tl.cast(QA, tl.uint32) + tl.cast(SA, tl.uint32)
    return _mix_a((w0 ^ k) + w1 * tl.cast(QB, tl.uint32))


@triton.jit
def _xor_combine(a, b):
    return a ^ b


@triton.jit
def _max_u16x2(a, b, INTERP: tl.constexpr = False):
    # unsigned max of each 16-bit half (one instruction on sm_90; the CPU interpreter has no asm)
    if INTERP:
        m16 = tl.cast(0xFFFF, tl.uint32)
        r = tl.maximum(a & m16, b & m16) | (tl.maximum(a >> 16, b >> 16) << 16)
    else:
        r = tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32,
                                      is_pure=True, pack=1)
    return r


@triton.jit
def _sgn(hr, c: tl.constexpr):
    # +-1.0 from bit c of the row hash: the bit moved to the float's sign
    return (((hr << (31 - c)) & tl.cast(0x80000000, tl.uint32)) | tl.cast(0x3F800000, tl.uint32)
            ).to(tl.float32, bitcast=True)


@triton.jit
def _sq2(lo, hi, acc):
    return tl.fma(hi, hi, tl.fma(lo, lo, acc))


@triton.jit
def _q4(x, BR: tl.constexpr, W: tl.constexpr):
    # [BR, W] -> 4 x [BR, W // 4]: each thread's 4 contiguous words, as 4 tensors (in registers)
    a, b = tl.split(tl.reshape(x, (BR, W // 4, 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _pick4(x, BR: tl.constexpr, W: tl.constexpr):
    # [BR, W] -> [BR, W // 4]: the first of each 4 (the layout of _q4's results)
    a, b = tl.split(tl.reshape(x, (BR, W // 4, 2, 2)))
    a, b = tl.split(a)
    return a


@triton.jit
def _side(w, q, s0, s1, s2, s3, S, acc_s, acc_x, nwords, BR: tl.constexpr, W: tl.constexpr,
          DT: tl.constexpr, MASKED: tl.constexpr, SKIP: tl.constexpr, INTERP: tl.constexpr):
    """W words of each of BR sign rows (each thread: 4 contiguous words of one row); q their
    word indices in the tensor, s0..s3 the rows' sign copies ([BR, 1]), S the side's
    per-position accumulators.  Returns S, the hash lanes and the per-thread OR of the magnitude
    bits ([BR, W // 4])."""
    z0l, z0h, z1l, z1h, z2l, z2h, z3l, z3h, acc_sq, acc_mx = S
    if DT == 0:
        fl = (w << 16).to(tl.float32, bitcast=True)
        fh = (w & tl.cast(0xFFFF0000, tl.uint32)).to(tl.float32, bitcast=True)
    else:
        fl = w.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        fh = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    if SKIP & 1 == 0:
        # sketch: Z_c[col] += b_c(row) * x[row, col], c = 0..3 (4 row-sign copies)
        z0l, z0h = tl.fma(fl, s0, z0l), tl.fma(fh, s0, z0h)
        z1l, z1h = tl.fma(fl, s1, z1l), tl.fma(fh, s1, z1h)
        z2l, z2h = tl.fma(fl, s2, z2l), tl.fma(fh, s2, z2h)
        z3l, z3h = tl.fma(fl, s3, z3l), tl.fma(fh, s3, z3h)
    am = w & tl.cast(0x7FFF7FFF, tl.uint32)           # magnitude bits of both halves
    a0, a1, a2, a3 = _q4(am, BR, W)
    if SKIP & 2 == 0:
        # hash: one mixer per pair of words (each thread's 4 words are 2 pairs); lanes: the sum
        # and the xor of the pair hashes
        w0, w1, w2, w3 = _q4(w, BR, W)
        p0 = _q4(q, BR, W)[0] // 2
        h0 = _pair(w0, w1, p0)
        h1 = _pair(w2, w3, p0 + 1)
        if MASKED:   # pairs past the end are zero; their hashes are not
            h0 = tl.where(2 * p0 < nwords, h0, tl.zeros_like(h0))
            h1 = tl.where(2 * p0 + 2 < nwords, h1, tl.zeros_like(h1))
        acc_s = acc_s + (h0 + h1)
        acc_x = acc_x ^ (h0 ^ h1)
    if SKIP & 4 == 0:
        # per thread, not per position: the thread's 4 words fold into one accumulator
        l0, l1, l2, l3 = _q4(fl, BR, W)
        h0, h1, h2, h3 = _q4(fh, BR, W)
        acc_sq = _sq2(l3, h3, _sq2(l2, h2, _sq2(l1, h1, _sq2(l0, h0, acc_sq))))
        acc_mx = _max_u16x2(acc_mx, _max_u16x2(_max_u16x2(a0, a1, INTERP), _max_u16x2(a2, a3, INTERP),
                                               INTERP), INTERP)
    return (z0l, z0h, z1l, z1h, z2l, z2h, z3l, z3h, acc_sq, acc_mx), acc_s, acc_x, (a0 | a1) | (a2 | a3)


@triton.jit
def _tile(wt, t, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords, nbrows, bpt_m, bpt_s,
          BR: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr, DT: tl.constexpr, DO_FLAGS: tl.constexpr,
          MASKED: tl.constexpr, SKIP: tl.constexpr,
          INTERP: tl.constexpr):
    """One tile of BR sign rows: wt = the SPLIT sides' words ([BR, W] each, side i = words
    i*W .. i*W + W - 1 of each row), SS their accumulators."""
    rows = t * BR + rows_l                                         # [BR, 1]
    hr = _mix_a(rows.to(tl.uint32) ^ sb0)
    s0 = _sgn(hr, 0)
    s1 = _sgn(hr, 1)
    s2 = _sgn(hr, 2)
    s3 = _sgn(hr, 3)
    q = tl.cast(t, tl.int64) * (BR * 64) + off
    L, acc_s, acc_x, nz = _side(wt[0], q, s0, s1, s2, s3, SS[0], acc_s, acc_x, nwords, BR, W, DT,
                                MASKED, SKIP, INTERP)
    if SPLIT == 2:
        R, acc_s, acc_x, nzb = _side(wt[1], q + W, s0, s1, s2, s3, SS[1], acc_s, acc_x, nwords,
                                     BR, W, DT, MASKED, SKIP, INTERP)
        nz = nz | nzb
        SS = (L, R)
    else:
        SS = (L,)
    if DO_FLAGS:
        # each thread flags the token of its row where its words are not all zero
        m = nz != 0
        if MASKED:
            m = m & (_pick4(tl.broadcast_to(rows, (BR, W)), BR, W) < nbrows)
        # the token of each row: rows // bpt by a multiply-high (bpt_m == 0: bpt is 1), so
        # the divisor is a runtime value and not one more specialization per hidden size
        mg = tl.cast(bpt_m, tl.int32).to(tl.uint32, bitcast=True)       # passed as an int32
        rt = tl.where(bpt_m == 0, rows, (tl.umulhi(rows.to(tl.uint32), mg) >> bpt_s).to(rows.dtype))
        tok = _pick4(tl.broadcast_to(rt, (BR, W)), BR, W)
        if not INTERP:
            # a predicated store in the tensor's own layout (tl.store would move the mask
            # through shared memory to a layout of its choosing)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p st.global.b32 [$1], 1; mov.b32 $0, 0; }",
                "=r,l,r", [flag_ptr + tok, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.store(flag_ptr + tok, tl.full((BR, W // 4), 1, tl.int32), mask=m)
    return SS, acc_s, acc_x


@triton.jit
def _ld(base, t, nfull, TW: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr, CHECK: tl.constexpr):
    """The SPLIT sides of full tile t (all zero, nothing read, when CHECK and t >= nfull)."""
    p = base + tl.cast(t, tl.int64) * TW
    if CHECK:
        ok = t < nfull
        a = tl.load(p, mask=ok, other=0).to(tl.uint32, bitcast=True)
        if SPLIT == 2:
            r = (a, tl.load(p + W, mask=ok, other=0).to(tl.uint32, bitcast=True))
        else:
            r = (a,)
    else:
        a = tl.load(p).to(tl.uint32, bitcast=True)
        if SPLIT == 2:
            r = (a, tl.load(p + W).to(tl.uint32, bitcast=True))
        else:
            r = (a,)
    return r


@triton.jit
def _zeros(BR: tl.constexpr, W: tl.constexpr):
    z = tl.zeros([BR, W], tl.float32)
    return (z, z, z, z, z, z, z, z, _q4(z, BR, W)[0], _q4(tl.zeros([BR, W], tl.uint32), BR, W)[0])


@triton.jit
def _proj(S, a_ptr, w0: tl.constexpr, W: tl.constexpr, KP: tl.constexpr):
    """Sum over the side's W words x 2 halves of a_j(col) * Z_(j%4)[col] -> [KP]."""
    z0l, z0h, z1l, z1h, z2l, z2h, z3l, z3h, sq, mx = S
    c = tl.arange(0, W)[:, None]
    j = tl.arange(0, KP)[None, :]
    alo = tl.load(a_ptr + ((w0 + c) * 2) * KP + j)                   # [W, KP]
    ahi = tl.load(a_ptr + ((w0 + c) * 2 + 1) * KP + j)
    jc = j % 4
    zl = tl.where(jc == 0, tl.sum(z0l, axis=0)[:, None],
                  tl.where(jc == 1, tl.sum(z1l, axis=0)[:, None],
                           tl.where(jc == 2, tl.sum(z2l, axis=0)[:, None], tl.sum(z3l, axis=0)[:, None])))
    zh = tl.where(jc == 0, tl.sum(z0h, axis=0)[:, None],
                  tl.where(jc == 1, tl.sum(z1h, axis=0)[:, None],
                           tl.where(jc == 2, tl.sum(z2h, axis=0)[:, None], tl.sum(z3h, axis=0)[:, None])))
    return tl.sum(zl * alo + zh * ahi, axis=0)


# The sizes are runtime values, never specialised (no constant 1, no divisibility by 16): one
# binary per dtype / k / flags takes every shape (tests/test_kernel_compile.py compiles them all).
# Their loads and stores need no size hints: full tiles are unmasked or masked by a scalar.
@triton.jit(do_not_specialize=["nwords", "nbrows", "nfull", "ntiles", "salt_b0", "NPROG", "bpt_m", "bpt_s"])
def _fp16_kernel(w_ptr, a_ptr, fpart_ptr, ipart_ptr, flag_ptr,
                 nwords, nbrows, nfull, ntiles, salt_b0, NPROG, bpt_m, bpt_s,
                 DT: tl.constexpr, BR: tl.constexpr, KP: tl.constexpr, DO_FLAGS: tl.constexpr, SPLIT: tl.constexpr = 2,
                 DEPTH: tl.constexpr = 2, SKIP: tl.constexpr = 0, INTERP: tl.constexpr = False):
    """16-bit tensors (bf16 / fp16) read as 32-bit words, sign rows of 64 words.

    A persistent grid walks tiles of BR sign rows; each thread holds 4 contiguous words of one
    row per side (SPLIT sides of 64 / SPLIT words: 2 sides = 8 words of a row per thread).  The
    loop is unrolled DEPTH times over a ring of tiles, so DEPTH - 1 tiles' 16-byte loads are in
    flight while one is worked on, with no register copies.  Everything is elementwise in
    registers and accumulated per position, reduced once at the end: no shared memory and no
    barrier in the loop.  Per word: one mixer for the hash, 2 FMAs for the sum of squares, a 16x2
    max of the magnitude bits and 8 FMAs for the sketch, which keeps 4 row-sign copies per column
    Z_c[col] = sum_r b_c(r) x[r, col]; the epilogue projects them on the column signs:
    sketch_j = sum_col a_j(col) Z_(j%4)[col]."""
    pid = tl.program_id(0)
    W: tl.constexpr = 64 // SPLIT
    TW: tl.constexpr = BR * 64
    rows_l = tl.arange(0, BR)[:, None]
    off = rows_l * 64 + tl.arange(0, W)[None, :]       # [BR, W] word offsets of side 0
    sb0 = tl.cast(salt_b0, tl.uint32)
    if SPLIT == 2:
        SS = (_zeros(BR, W), _zeros(BR, W))
    else:
        SS = (_zeros(BR, W),)
    acc_s = tl.zeros([BR, W // 4], tl.uint32)
    acc_x = tl.zeros([BR, W // 4], tl.uint32)
    base = w_ptr + off
    t = pid
    if DEPTH == 2:
        wa = _ld(base, t, nfull, TW, W, SPLIT, True)
        for _ in range(pid, nfull - NPROG, 2 * NPROG):          # tiles t, t + NPROG: full
            wb = _ld(base, t + NPROG, nfull, TW, W, SPLIT, False)
            SS, acc_s, acc_x = _tile(wa, t, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords,
                                     nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
            wa = _ld(base, t + 2 * NPROG, nfull, TW, W, SPLIT, True)
            SS, acc_s, acc_x = _tile(wb, t + NPROG, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr,
                                     nwords, nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
            t += 2 * NPROG
    else:
        wa = _ld(base, t, nfull, TW, W, SPLIT, True)
        wb = _ld(base, t + NPROG, nfull, TW, W, SPLIT, True)
        for _ in range(pid, nfull - 2 * NPROG, 3 * NPROG):      # tiles t .. t + 2 NPROG: full
            wc = _ld(base, t + 2 * NPROG, nfull, TW, W, SPLIT, False)
            SS, acc_s, acc_x = _tile(wa, t, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords,
                                     nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
            wa = _ld(base, t + 3 * NPROG, nfull, TW, W, SPLIT, True)
            SS, acc_s, acc_x = _tile(wb, t + NPROG, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr,
                                     nwords, nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
            wb = _ld(base, t + 4 * NPROG, nfull, TW, W, SPLIT, True)
            SS, acc_s, acc_x = _tile(wc, t + 2 * NPROG, off, rows_l, sb0, SS, acc_s, acc_x,
                                     flag_ptr, nwords, nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS,
                                     False, SKIP, INTERP)
            t += 3 * NPROG
        if t + NPROG < nfull:      # two full tiles left (already loaded): the first one here
            SS, acc_s, acc_x = _tile(wa, t, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords,
                                     nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
            wa = wb
            t += NPROG
    if t < nfull:        # one full tile left (already loaded)
        SS, acc_s, acc_x = _tile(wa, t, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords,
                                 nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, False, SKIP, INTERP)
    if (nfull < ntiles) & (pid == nfull % NPROG):       # the one partial tile, masked
        # tl.cast, not .to: an int argument equal to 1 arrives as a Python int (Triton
        # specialises it to a constant), which has no .to
        q = tl.cast(nfull, tl.int64) * TW + off
        a = tl.load(w_ptr + q, mask=q < nwords, other=0).to(tl.uint32, bitcast=True)
        if SPLIT == 2:
            wt = (a, tl.load(w_ptr + q + W, mask=q + W < nwords, other=0).to(tl.uint32, bitcast=True))
        else:
            wt = (a,)
        SS, acc_s, acc_x = _tile(wt, nfull, off, rows_l, sb0, SS, acc_s, acc_x, flag_ptr, nwords,
                                 nbrows, bpt_m, bpt_s, BR, W, SPLIT, DT, DO_FLAGS, True, SKIP, INTERP)
    # epilogue: project Z on the column signs; one row of partials per program
    L = SS[0]
    sk = _proj(L, a_ptr, 0, W, KP)
    sq = tl.sum(tl.sum(L[8], axis=1), axis=0)
    mxw = L[9]
    if SPLIT == 2:
        R = SS[1]
        sk += _proj(R, a_ptr, W, W, KP)
        sq += tl.sum(tl.sum(R[8], axis=1), axis=0)
        mxw = _max_u16x2(mxw, R[9], INTERP)
    fbase = fpart_ptr + pid * (KP + 2)
    tl.store(fbase + tl.arange(0, KP), sk)
    tl.store(fbase + KP, sq)
    mx = tl.max(tl.max(tl.maximum(mxw & 0xFFFF, mxw >> 16), axis=1), axis=0)
    if DT == 0:
        tl.store(fbase + KP + 1, (mx << 16).to(tl.float32, bitcast=True))
    else:
        tl.store(fbase + KP + 1, mx.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))
    ibase = ipart_ptr + pid * 4
    tl.store(ibase, tl.sum(tl.sum(acc_s, axis=1), axis=0).to(tl.int64))
    tl.store(ibase + 1, tl.reduce(tl.reduce(acc_x, 1, _xor_combine), 0, _xor_combine).to(tl.int64))
    tl.store(ibase + 2, tl.cast(0, tl.int64))
    tl.store(ibase + 3, tl.cast(0, tl.int64))

@triton.jit(do_not_specialize=["nbrows", "brows_per_token", "iters", "salt_b0", "NPROG"])
def _fp32_kernel(w_ptr, a_ptr, fpart_ptr, ipart_ptr, flag_ptr, nwords, nbrows, brows_per_token,
                 iters, salt_b0, NPROG, BLOCK_R: tl.constexpr, KP: tl.constexpr,
                 DO_FLAGS: tl.constexpr):
    """fp32 tensors: tiles of BLOCK_R sign rows x 128 words, grid-stride; the sketch as
    Y = X_tile @ A (ieee fp32 dot, A = the +-1 column signs), weighed by the row signs."""
    pid = tl.program_id(0)
    r_off = tl.arange(0, BLOCK_R)
    c_off = tl.arange(0, 128)
    j = tl.arange(0, KP)
    amat = tl.load(a_ptr + c_off[:, None] * KP + j[None, :])
    sb0 = tl.cast(salt_b0, tl.uint32)
    jc = (j % 4).to(tl.uint32)
    acc_sk = tl.zeros([KP], tl.float32)
    acc_sq = tl.zeros([BLOCK_R], tl.float32)
    acc_mx = tl.zeros([BLOCK_R], tl.float32)
    acc_s = tl.zeros([BLOCK_R], tl.uint32)
    acc_x = tl.zeros([BLOCK_R], tl.uint32)
    acc_nan = tl.zeros([BLOCK_R], tl.int32)
    acc_inf = tl.zeros([BLOCK_R], tl.int32)
    for it in range(0, iters):
        rows = (pid + it * NPROG) * BLOCK_R + r_off
        q = rows.to(tl.int64)[:, None] * 128 + c_off[None, :]
        m = q < nwords
        w = tl.load(w_ptr + q, mask=m, other=0).to(tl.uint32, bitcast=True)
        w0, w1 = tl.split(tl.reshape(w, (BLOCK_R, 64, 2)))
        p0, _ = tl.split(tl.reshape(q, (BLOCK_R, 64, 2)))
        h = _pair(w0, w1, p0 // 2)
        h = tl.where(p0 < nwords, h, tl.zeros_like(h))
        acc_s += tl.sum(h, axis=1)
        acc_x ^= tl.reduce(h, 1, _xor_combine)
        x = w.to(tl.float32, bitcast=True)
        y = tl.dot(x, amat, input_precision="ieee")
        acc_sq += tl.sum(x * x, axis=1)
        acc_mx = tl.maximum(acc_mx, tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1))
        acc_nan += tl.sum((x != x).to(tl.int32), axis=1)
        acc_inf += tl.sum((tl.abs(x) == float("inf")).to(tl.int32), axis=1)
        hr = _mix_a(rows.to(tl.uint32) ^ sb0)
        sgn = 1.0 - 2.0 * ((hr[:, None] >> jc[None, :]) & 1).to(tl.float32)
        acc_sk += tl.sum(y * sgn, axis=0)
        if DO_FLAGS:
            nz = tl.max((x != 0).to(tl.int32), axis=1)
            tl.atomic_max(flag_ptr + rows // brows_per_token, nz, mask=(rows < nbrows) & (nz > 0))
    fbase = fpart_ptr + pid * (KP + 2)
    tl.store(fbase + j, acc_sk)
    tl.store(fbase + KP, tl.sum(acc_sq, axis=0))
    tl.store(fbase + KP + 1, tl.max(acc_mx, axis=0))
    ibase = ipart_ptr + pid * 4
    tl.store(ibase, tl.sum(acc_s, axis=0).to(tl.int64))
    tl.store(ibase + 1, tl.reduce(acc_x, 0, _xor_combine).to(tl.int64))
    tl.store(ibase + 2, tl.sum(acc_nan, axis=0).to(tl.int64))
    tl.store(ibase + 3, tl.sum(acc_inf, axis=0).to(tl.int64))


# --------------------------------------------------------------------------- the device combine
# A forward's partials are reduced on the device (``_combine_kernel``, one program per tensor) into
# one small result buffer, so the host copies ~(6 + k) words and a token bitmap per tensor instead
# of every program's partials, and only formats.  The float sums run over the programs IN ORDER
# (acc = ((0.0 + p0) + p1) + ... + p_{n-1}, float64), which is how the host combine
# (``combine_many``) sums them too, so both give the same fingerprints to the bit.

DESC = 8          # int64 words of an item's descriptor (see _combine_kernel)
RES = 6           # int64 words of an item's result before its k sketch values
_RES, _DESC = tl.constexpr(RES), tl.constexpr(DESC)


@triton.jit(do_not_specialize=["K"])
def _combine_kernel(desc_ptr, ip_ptr, fp_ptr, gp_ptr, out_ptr, outf_ptr, outg_ptr, K,
                    CB: tl.constexpr, UNROLL: tl.constexpr, RB: tl.constexpr, FB: tl.constexpr):
    """One tensor's partials -> its result row.  Descriptor (int64): [int partials (int64 index
    from ip_ptr), float partials (float32 index from fp_ptr), token flags (int32 index from
    gp_ptr), programs n, kp, token rows (0: none), result row (int64 index), bitmap (int32 index)].
    Result row: [the bit hash's 2 words (fmix64 of the lanes: sum of word 0, xor of word 1, mod
    2^32), NaNs, Infs, sumsq, absmax (float64), sketch[0:K] (float64)]; the bitmap: the token
    flags, 32 a word (bit r of word r // 32)."""
    d = desc_ptr + tl.program_id(0) * _DESC
    io = tl.load(d)
    fo = tl.load(d + 1)
    go = tl.load(d + 2)
    n = tl.load(d + 3)
    kp = tl.load(d + 4)
    ntok = tl.load(d + 5)
    oo = tl.load(d + 6)
    bo = tl.load(d + 7)
    # integers: exact in any order
    r = tl.arange(0, RB)[:, None]
    c4 = tl.arange(0, 4)[None, :]
    s = tl.zeros([RB, 4], tl.int64)
    x = tl.zeros([RB, 4], tl.int64)
    for r0 in range(0, n, RB):
        v = tl.load(ip_ptr + io + (r0 + r) * 4 + c4, mask=(r0 + r) < n, other=0)
        s += v
        x ^= v
    ssum = tl.sum(s, axis=0)
    sxor = tl.reduce(x, 0, _xor_combine)
    c = tl.arange(0, 4)
    iv = tl.where(c == 1, sxor, ssum)
    # the bit hash's two words: fmix64(la), fmix64(lb ^ 0x5851F42D4C957F2D) (_hashdef.hash_hex)
    u = (iv & 0xFFFFFFFF).to(tl.uint64, bitcast=True)
    u = tl.where(c == 1, u ^ tl.cast(0x5851F42D4C957F2D, tl.uint64), u)
    u = (u ^ (u >> 30)) * tl.cast(0xBF58476D1CE4E5B9, tl.uint64)
    u = (u ^ (u >> 27)) * tl.cast(0x94D049BB133111EB, tl.uint64)
    u = u ^ (u >> 31)
    tl.store(out_ptr + oo + c, tl.where(c < 2, u.to(tl.int64, bitcast=True), iv))
    # floats: from +0.0 (numpy's start), program by program in order (UNROLL rows' loads in flight
    # at once); a row past n adds -0.0, which leaves any sum as it is
    col = tl.arange(0, CB)
    cm = col < kp + 2
    w = kp + 2
    acc = tl.zeros([CB], tl.float64)
    mx = tl.full([CB], float("-inf"), tl.float64)
    for r0 in range(0, n, UNROLL):
        for j in tl.static_range(UNROLL):
            ok = r0 + j < n
            v = tl.load(fp_ptr + fo + (r0 + j) * w + col, mask=cm & ok, other=-0.0).to(tl.float64)
            acc += v
            mx = tl.where(ok, tl.maximum(mx, v, propagate_nan=tl.PropagateNan.ALL), mx)
    dst = tl.where(col < K, oo + _RES + col, tl.where(col == kp, oo + 4, oo + 5))
    tl.store(outf_ptr + dst, tl.where(col == kp + 1, mx, acc), mask=(col < K) | (col == kp) | (col == kp + 1))
    # token flags -> a bitmap
    t = tl.arange(0, FB)
    sh = tl.arange(0, 32)[None, :].to(tl.uint32)
    wd = tl.arange(0, FB // 32)
    for t0 in range(0, ntok, FB):
        f = tl.load(gp_ptr + go + t0 + t, mask=(t0 + t) < ntok, other=0)
        bits = tl.reshape((f > 0).to(tl.uint32), (FB // 32, 32)) << sh
        word = tl.sum(bits, axis=1).to(tl.int32, bitcast=True)
        tl.store(outg_ptr + bo + t0 // 32 + wd, word, mask=(t0 // 32 + wd) * 32 < ntok)


def combine_call(desc, base, out, m: int, k: int, kp_max: int):
    """(kernel, grid, args, kwargs) of the device combine of m items: desc their [m, DESC]
    descriptors (a device int64 tensor), base the int64 buffer their indices count from, out the
    result buffer (int64)."""
    return (_combine_kernel, (m,),
            (desc, base, base.view(torch.float32), base.view(torch.int32), out, out.view(torch.float64),
             out.view(torch.int32), k),
            dict(CB=combine_cb(kp_max), UNROLL=16, RB=64, FB=1024, num_warps=1))


def combine_cb(kp_max: int) -> int:
    """The device combine's column block for items of at most kp_max sketch columns per row."""
    return triton.next_power_of_2(kp_max + 2)


# 16-bit tensors need sm_90's max.u16x2 (PTX ISA 8.0); the fp32 kernel builds from sm_80 on
MIN_CC = {torch.bfloat16: (9, 0), torch.float16: (9, 0), torch.float32: (8, 0)}


def unsupported_reason(shape, dtype, element_size: int, contiguous: bool, data_ptr: int,
                       cc: tuple) -> str:
    """Why a tensor of this layout takes the torch path on a GPU of compute capability ``cc``
    ("" when the fused kernel takes it)."""
    n = math.prod(shape)
    if dtype not in _DT:
        return f"{str(dtype).replace('torch.', '')}: no kernel for this dtype"
    if tuple(cc) < MIN_CC[dtype]:
        return (f"{str(dtype).replace('torch.', '')} on sm_{cc[0]}{cc[1]}: the kernel needs "
                f"sm_{MIN_CC[dtype][0]}{MIN_CC[dtype][1]} (max.u16x2)")
    if not contiguous:
        return "not contiguous"
    if n == 0:
        return "empty"
    if (n * element_size) % 4:
        return "odd byte count"
    if data_ptr % 16:
        return "not 16-byte aligned"
    if n * element_size // 4 >= 2 ** 31 - 2 ** 20:
        return "over 2^31 words"
    return ""


_CC: dict = {}


def device_cc(device) -> tuple:
    d = torch.device(device).index or 0
    if d not in _CC:
        _CC[d] = torch.cuda.get_device_capability(d)
    return _CC[d]


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and not unsupported_reason(tuple(t.shape), t.dtype, t.element_size(), t.is_contiguous(),
                                                t.data_ptr(), device_cc(t.device))


_A: dict = {}
_NSM: dict = {}


def _kp(k: int, dtype) -> int:
    # the fp32 kernel's dot needs N >= 16; the 16-bit kernel only needs the 4 row-sign copies
    return max(16 if dtype == torch.float32 else 4, triton.next_power_of_2(k))


def sign_table(seed: int, k: int, kp: int, device) -> torch.Tensor:
    """[128, kp] float32 column signs a_j(c), zero columns past k."""
    key = (seed, k, kp, str(device))
    v = _A.get(key)
    if v is None:
        a = torch.zeros(F.SKETCH_ROW, kp, dtype=torch.float64)
        a[:, :k] = F.column_signs(seed, k)
        v = _A[key] = a.to(device, torch.float32).contiguous()
    return v


_INTERP = bool(os.environ.get("TRITON_INTERPRET"))   # Triton's CPU interpreter (tests of the logic)


def _nsm(device) -> int:
    if torch.device(device).type != "cuda":
        return 2
    d = torch.device(device).index or 0
    if d not in _NSM:
        _NSM[d] = torch.cuda.get_device_properties(d).multi_processor_count
    return _NSM[d]


def _env(name: str, default: int) -> int:
    return knob_int(name)


def tuning(block_r=None, num_warps=None, progs_per_sm=None, maxnreg=None, split=None, depth=None):
    return dict(block_r=block_r or _env("TPPROBE_FP_BLOCK_R", 16),
                num_warps=num_warps or _env("TPPROBE_FP_WARPS", 4),
                progs_per_sm=progs_per_sm or _env("TPPROBE_FP_PROGS", 3),
                maxnreg=maxnreg if maxnreg is not None else _env("TPPROBE_FP_MAXNREG", 144),
                split=split or _env("TPPROBE_FP_SPLIT", 2),
                depth=depth or _env("TPPROBE_FP_DEPTH", 3))

_tuning, _cc = tuning, device_cc     # the names tests and bench/ use


def plan(tensors, k: int, nsm: int, block_r: int, progs_per_sm: int, **_) -> tuple[list, int, int, int]:
    """Per tensor: the sizes launch() passes its kernel; and the partial buffers' sizes
    (int64 words, float32 words, token flags).  Needs only shape, dtype and element size, so the
    CI test (tests/test_kernel_compile.py) plans meta tensors of any size exactly as launch() does."""
    plans = []
    foff = ioff = ntok = 0
    for t in tensors:
        kp = _kp(k, t.dtype)
        n = t.numel()
        nwords = n * t.element_size() // 4
        nbrows = -(-n // F.SKETCH_ROW)
        br = block_r if t.dtype != torch.float32 else 16
        ntiles = -(-nbrows // br)
        nprog = max(1, min(ntiles, progs_per_sm * nsm))
        flags = t.dim() == 2 and t.shape[1] % F.SKETCH_ROW == 0 and t.shape[1] > 0
        plans.append(dict(t=t, shape=list(t.shape), dtype=t.dtype, dtype_s=str(t.dtype).replace("torch.", ""), kp=kp,
                          br=br, nwords=nwords, nbrows=nbrows, ntiles=ntiles, nprog=nprog, flags=flags, foff=foff,
                          ioff=ioff, toff=ntok))
        # every slice 16-byte aligned: one pointer specialization, whatever the shapes
        foff += -(-nprog * (kp + 2) // 4) * 4
        ioff += nprog * 4
        if flags:
            ntok += -(-t.shape[0] // 4) * 4
    return plans, ioff, foff, ntok


def plan_one(shape, dtype, device, k: int, foff: int, ioff: int, toff: int, knobs: dict) -> dict:
    """``plan`` of one tensor known by (shape, dtype, device) only, its partials at the given
    offsets; with its sizes nf / ni / nt (float32 / int64 / token-flag words).  A CUDA-graph tap
    (capture/graph_tap.py) lays out its static buffer with it before the forward it captures."""
    [p], ni, nf, nt = plan([torch.empty(tuple(shape), dtype=dtype, device="meta")], k, _nsm(device), **knobs)
    del p["t"]
    p.update(foff=foff, ioff=ioff, toff=toff, nf=nf, ni=ni, nt=nt)
    return p


def buffer_words(ioff: int, foff: int, ntok: int) -> int:
    return max(ioff + (foff + 1) // 2 + (ntok + 1) // 2, 1)


def split_buffer(buf, ioff: int, foff: int):
    """(int64 partials, float32 partials, int32 token flags) views of one batch buffer, device
    tensor or host numpy array alike: [int64 partials | float32 partials | int32 token flags]."""
    nf64 = (foff + 1) // 2
    if isinstance(buf, np.ndarray):
        return buf[:ioff], buf[ioff:ioff + nf64].view(np.float32), buf[ioff + nf64:].view(np.int32)
    return buf[:ioff], buf[ioff:ioff + nf64].view(torch.float32), buf[ioff + nf64:].view(torch.int32)


def buffers(ioff: int, foff: int, ntok: int, device):
    """One buffer: [int64 partials | float32 partials | int32 token flags]."""
    buf = torch.empty(buffer_words(ioff, foff, ntok), dtype=torch.int64, device=device)
    return (buf, *split_buffer(buf, ioff, foff))


def _divmagic(d: int) -> tuple[int, int]:
    """(m, s) with n // d == umulhi(n, m) >> s for every 0 <= n < 2^31 (m as the int32 of its
    bits); (0, 0) for d == 1."""
    if d == 1:
        return 0, 0
    lg = (d - 1).bit_length()
    m = (1 << (31 + lg)) // d + 1          # < 2^32; passed as the int32 of the same bits
    return m - (1 << 32) if m >= 1 << 31 else m, lg - 1


def calls(plans, bufs, seed: int, k: int, tune: dict, skip: int = 0, signs=None):
    """(kernel, grid, args, kwargs) of each launch, in order.  ``signs(kp)`` gives the column-sign
    matrix (a device tensor in launch(); anything with a data_ptr in the compile test)."""
    _, ipart, fpart, flagbuf = bufs
    salt = F.row_salts(seed, 1)[0]
    out = []
    for p in plans:
        t = p["t"]
        words = t.view(-1).view(torch.int32)
        flag = flagbuf[p["toff"]:] if p["flags"] else flagbuf
        bpt = (t.shape[1] // F.SKETCH_ROW) if p["flags"] else 1
        a = signs(p["kp"])
        if t.dtype == torch.float32:
            out.append((_fp32_kernel, (p["nprog"],),
                        (words, a, fpart[p["foff"]:], ipart[p["ioff"]:], flag, p["nwords"], p["nbrows"], bpt,
                         -(-p["ntiles"] // p["nprog"]), salt, p["nprog"]),
                        dict(BLOCK_R=p["br"], KP=p["kp"], DO_FLAGS=p["flags"], num_warps=4)))
            continue
        kw = {"maxnreg": tune["maxnreg"]} if tune["maxnreg"] and not _INTERP else {}
        out.append((_fp16_kernel, (p["nprog"],),
                    (words, a, fpart[p["foff"]:], ipart[p["ioff"]:], flag, p["nwords"], p["nbrows"],
                     p["nwords"] // (p["br"] * 64), p["ntiles"], salt, p["nprog"], *_divmagic(bpt)),
                    dict(DT=_DT[t.dtype], BR=p["br"], KP=p["kp"],
                         DO_FLAGS=p["flags"], SPLIT=tune["split"], DEPTH=tune["depth"], SKIP=skip,
                         INTERP=_INTERP, num_warps=tune["num_warps"], **kw)))
    return out


def launch_one(p: dict, t: torch.Tensor, ipart, fpart, flagbuf, seed: int, k: int, knobs: dict,
               skip: int = 0) -> None:
    """One kernel launch writing tensor t's partials at plan p's offsets (no allocation, no sync:
    the token-flag words must be zero before, which the caller does once per batch)."""
    for kern, grid, args, kw in calls([dict(p, t=t)], (None, ipart, fpart, flagbuf), seed, k, knobs, skip,
                                      signs=lambda kp: sign_table(seed, k, kp, t.device)):
        kern[grid](*args, **kw)


def combine_one(p: dict, hi, hf, hflag, seed: int, k: int, rows_extra=None, tensor=None) -> F.Fingerprint:
    """The host combine of one tensor's partials at plan p's offsets (``combine_many`` of one)."""
    return combine_many(p, hi, hf, hflag, [p["ioff"]], [p["foff"]], [p["toff"]], seed, k,
                        rows_extra=[rows_extra], tensors=[tensor])[0]


def combine_many(p: dict, hi, hf, hflag, ioffs, foffs, toffs, seed: int, k: int, rows_extra=None,
                 tensors=None) -> list:
    """The host combine (exact integers, float64) of m tensors of one plan (same shape and dtype)
    from the copied buffer (numpy views: int64 partials hi, float32 partials hf, int32 token flags
    hflag; item i's at ioffs[i] / foffs[i] / toffs[i] in them): one gather and a few numpy
    reductions for all m.  The float sums run over the programs in order (p0 + p1 + ..., never
    numpy's pairwise sum), as the device combine (``_combine_kernel``) adds them, so both give
    the same fingerprints to the bit.  A 16-bit tensor with NaN / Inf gets its exact counts
    from tensors[i] when it is still there; without it (a CUDA-graph tap reads after replay) the
    counts say at least one."""
    kp, n = p["kp"], p["nprog"]
    io, fo = np.asarray(ioffs, dtype=np.int64), np.asarray(foffs, dtype=np.int64)
    m = len(io)
    ip = hi[io[:, None] + np.arange(n * 4)].reshape(m, n, 4)      # partials < 2^32: exact in int64
    fp = hf[fo[:, None] + np.arange(n * (kp + 2))].reshape(m, n, kp + 2).astype(np.float64)
    la = (ip[:, :, 0].sum(1) & F.M32).tolist()
    lb = (np.bitwise_xor.reduce(ip[:, :, 1], axis=1) & F.M32).tolist()
    nans, infs = ip[:, :, 2].sum(1).tolist(), ip[:, :, 3].sum(1).tolist()
    # in order, as the device adds: numpy reduces a middle axis row by row from 0.0 (out += row
    # i); its pairwise sum is only along the innermost axis (tests/fp_interp.py: synthetic() sees
    # a change of either)
    acc = fp[:, :, :kp + 1].sum(1)
    sk, sumsq, absmax = acc[:, :k].tolist(), acc[:, kp].tolist(), fp[:, :, kp + 1].max(1).tolist()
    if p["flags"]:
        flags = hflag[np.asarray(toffs, dtype=np.int64)[:, None] + np.arange(p["shape"][0])] > 0
        rows = [r.tobytes().hex() for r in np.packbits(flags, axis=1, bitorder="little")]
    else:
        rows = ["" if x is None else _bitmap_hex_np(x) for x in (rows_extra or [None] * m)]
    return [make_fp(p, la[i], lb[i], nans[i], infs[i], sumsq[i], absmax[i], sk[i], rows[i],
                    tensors[i] if tensors else None, seed) for i in range(m)]


def make_fp(p: dict, la: int, lb: int, n_nan: int, n_inf: int, s: float, a: float, sketch: list, rows: str,
            t, seed: int) -> F.Fingerprint:
    """One tensor's Fingerprint from its host-combined values."""
    if not (math.isfinite(s) and math.isfinite(a)):
        s, a, n_nan, n_inf = _exact_nonfinite(p, s, a, n_nan, n_inf, t)
    return F.Fingerprint(shape=list(p["shape"]), dtype=p["dtype_s"], bit_hash=F.hash_hex(la, lb), sketch=sketch,
                         sumsq=s, absmax=a, n_nan=n_nan, n_inf=n_inf, row_nonzero=rows, seed=seed)


def _exact_nonfinite(p: dict, s: float, a: float, n_nan: int, n_inf: int, t):
    """sumsq, absmax, n_nan, n_inf of a tensor whose combined sum of squares or max |x| is not
    finite: a 16-bit tensor's exact counts come from the tensor when it is still there; without
    it (a CUDA-graph tap reads after replay) the counts say at least one."""
    if p["dtype"] == torch.float32:       # the fp32 kernel counts them exactly
        return s, a, n_nan, n_inf
    if t is not None:
        return _nonfinite_stats(t)
    return s, a, int(math.isnan(s)), int(math.isinf(a))


def launch(tensors, seed: int, k: int, block_r=None, num_warps=None, progs_per_sm=None,
           maxnreg=None, split=None, depth=None, skip: int = 0):
    """Launch the kernels for a batch; returns (host-side finisher, device buffer).  Nothing here
    synchronises; ``finish()`` does the one D2H copy.  block_r / num_warps / progs_per_sm /
    maxnreg / split / depth tune the 16-bit kernel's schedule, never its result (defaults
    16 / 4 / 3 / 144 / 2 / 3, the fastest on the H200 in bench/fingerprint_gpu.py --tune; or
    TPPROBE_FP_BLOCK_R, _WARPS, _PROGS, _MAXNREG, _SPLIT, _DEPTH in the environment); ``skip``
    leaves stages out (benchmark ablations only: wrong results)."""
    tune = tuning(block_r, num_warps, progs_per_sm, maxnreg, split, depth)
    dev = tensors[0].device
    plans, ioff, foff, ntok = plan(tensors, k, _nsm(dev), **tune)
    bufs = buffers(ioff, foff, ntok, dev)
    buf, flagbuf = bufs[0], bufs[3]
    if ntok:
        flagbuf.zero_()
    for kern, grid, args, kw in calls(plans, bufs, seed, k, tune, skip,
                                      signs=lambda kp: sign_table(seed, k, kp, dev)):
        kern[grid](*args, **kw)
    # token-row flags for 2-D tensors whose width is not a multiple of 128: torch
    extra = {i: (p["t"] != 0).any(dim=1) for i, p in enumerate(plans)
             if p["t"].dim() == 2 and not p["flags"]}

    def finish(host_parts=None):
        # one D2H copy, then numpy on the host buffer (a few microseconds per op, where a
        # torch op on small CPU tensors costs ten): the combine is exact integers / float64.
        # host_parts: finish.parts already copied by the caller (fingerprint.Deferred copies
        # every launch of a forward in one transfer)
        if host_parts is None:
            host_parts = [v.cpu().numpy() for v in finish.parts]
        ex = {i: v.astype(bool) for i, v in zip(extra, host_parts[1:])}
        hi, hf, hflag = split_buffer(host_parts[0], ioff, foff)
        return [combine_one(p, hi, hf, hflag, seed, k, rows_extra=ex.get(i), tensor=p["t"])
                for i, p in enumerate(plans)]

    finish.parts = [buf, *(v.to(torch.int64) for v in extra.values())]
    return finish, buf


def _bitmap_hex_np(flags) -> str:
    """``fingerprint._bitmap_hex`` on a numpy bool array: bit r of byte r // 8, little-endian."""
    return np.packbits(flags.astype(np.uint8), bitorder="little").tobytes().hex()


def _nonfinite_stats(t: torch.Tensor):
    """sumsq, absmax, n_nan, n_inf as ``fingerprint._fingerprint_torch`` computes them."""
    x = t.detach().reshape(-1).float()
    isn = torch.isnan(x)
    n_nan = int(isn.sum())
    n_inf = int(torch.isinf(x).sum())
    absmax = float(torch.where(isn, torch.zeros_like(x), x.abs()).max())
    sumsq = float("nan") if n_nan else float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
    return sumsq, absmax, n_nan, n_inf


def fingerprint_batch(tensors, seed: int, k: int, **kw):
    finish, _ = launch(tensors, seed, k, **kw)
    return finish()



# --------------------------------------------------------------------------- a forward's batch
# What one launch needs besides the tensor's address depends only on its shape, dtype and device
# and on (seed, k, knobs): the plan, the grid, the integer arguments, the sign table.  `Batch`
# keeps them per shape (an `_Entry`, built once per process) and lays every launch's partials out
# in one device buffer per forward (zeroed once: the token flags need it), so a launch is the
# kernel launch and nothing else.  The first launch of a shape goes through `JITFunction.run`
# (which compiles, or finds the binary, and returns Triton's CompiledKernel); later ones call
# that CompiledKernel's launcher directly with integer addresses (Triton's launcher takes an int
# for a pointer), as `JITFunction.run` itself does once it has bound the arguments: the binder,
# the specialisation key and the cache look-up it repeats per call are what they were at the
# first launch, because the integer arguments are the same and every pointer is 16-byte aligned
# (the tensor's is checked per launch; the partials' offsets are multiples of 16 bytes).
# TPPROBE_FP_JIT=1, a launch hook (a profiler's) or the CPU interpreter keep JITFunction.run.

class _Entry:
    __slots__ = ("why", "p", "dev", "kern", "grid", "ints", "kw", "tail", "sign", "aptr", "ni", "nf", "words",
                 "extra", "ck", "launcher", "function", "metadata", "drow")


_ENTRIES: dict = {}    # (seed, k, knobs, skip) -> {(shape, dtype, device index): _Entry}
_FREE: dict = {}       # device -> partial buffers a finished batch gave back
_WANT: dict = {}       # device -> words the last batch needed (the next one's first buffer)
_PINNED: dict = {}     # device index -> pinned host buffer for the one copy
_COMBINE: dict = {}    # device -> (descriptor staging: pinned host, device), result buffer
_COMBINE_CK: dict = {}   # (device, CB) -> the combine's (launch, function, middle arguments, constexprs, ck)
COMBINE_WHY: list = []   # why the device combine was given up (then every batch combines on the host)


def _no_hook(h) -> bool:
    # Triton 3.x's launch hooks are HookChains, empty unless a profiler (proton) added one
    return h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls)


def _direct_launch_ok() -> bool:
    if _INTERP or knob_set("TPPROBE_FP_JIT"):
        return False
    try:
        rt = triton.knobs.runtime
        return _no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)
    except AttributeError:       # a Triton without knobs: keep JITFunction.run
        return False


# Triton 3.6's CudaLauncher.__call__ (names it reads, exactly): it allocates the global and
# profile scratch (neither kernel here has any), then calls its C `launch` with the cooperative-grid
# and PDL flags and the two scratch pointers put before the rest of its arguments.
_LAUNCHER_3_6 = frozenset(("_allocation", "_allocator", "_profile_allocator", "global_scratch_size",
                           "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "launch",
                           "launch_cooperative_grid", "launch_pdl"))


def launch_of(ck):
    """(launch, the arguments between the function and the kernel's own) for a compiled kernel:
    Triton 3.6's C launch itself when its launcher is exactly that form and needs no scratch (its
    Python ``__call__`` was ~4 us of every launch on the lent H200 host: a frame, two closures made
    and called), else the launcher, as ``JITFunction.run`` calls it."""
    run, meta = ck.run, ck.packed_metadata
    code = getattr(getattr(type(run), "__call__", None), "__code__", None)
    raw = getattr(run, "launch", None)
    if code is not None and raw is not None and set(code.co_names) == _LAUNCHER_3_6 \
            and code.co_argcount == 6 and code.co_flags & inspect.CO_VARARGS \
            and code.co_varnames[:6] == ("self", "gridX", "gridY", "gridZ", "stream", "function") \
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
        return raw, (run.launch_cooperative_grid, run.launch_pdl, None, None, meta, None, None, None)
    return run, (meta, None, None, None)


class Batch:
    """One forward's fused fingerprints: ``add`` queues one tensor's kernel on the current stream
    (no sync; no allocation but the batch's first), ``read`` combines every launch's partials on
    the device (one descriptor upload, one ``_combine_kernel`` launch) and brings the results to
    the host with ONE small device-to-host copy (or, with the host combine, copies every partial
    and combines them with ``combine_many``, per shape).  The TPPROBE_FP_* knobs are read once,
    here."""

    CHUNK = 1 << 16          # int64 words of a batch's first partials buffer (512 KiB) at least

    def __init__(self, seed: int, k: int, knobs=None, skip: int = 0, host_combine=None):
        self.seed, self.k, self.skip = seed, k, skip
        # the combine: on the device (one small copy per read) unless TPPROBE_FP_HOST_COMBINE=1
        # (bench/fp_small.py times both) or the device combine failed once in this process
        if host_combine is None:
            host_combine = knob_set("TPPROBE_FP_HOST_COMBINE") or bool(COMBINE_WHY)
        self.host_combine = host_combine
        self.knobs = tuning() if knobs is None else knobs
        self.entries = _ENTRIES.setdefault((seed, k, tuple(sorted(self.knobs.items())), skip), {})
        self.direct = _direct_launch_ok()     # read per batch: a hook a profiler adds takes effect
        self.stream = None                    # the driver's current-stream getter, at the first launch
        self.items: list = []    # (tag, entry, chunk index, word offset, tensor, row flags or None)
        self.chunks: list = []   # [device buffer, words used]
        self.buf = None
        self.base = self.cap = self.used = 0

    def add(self, t: torch.Tensor, tag) -> bool:
        """Queue t's kernel (its fingerprint goes to ``tag.fp`` on ``read``); False, with nothing
        queued, when the fused kernel does not take t (``unsupported_reason`` says why)."""
        e = self.entries.get((t.shape, t.dtype, t.get_device()))
        if e is None:
            e = self._entry(t)
        ptr = t.data_ptr()
        if e.why or ptr % 16 or not t.is_contiguous():
            return False
        off = self.used
        if off + e.words > self.cap:
            self._new_buffer(e.words, t.device)
            off = 0
        self.used = off + e.words
        if e.ck is not None and self.direct:
            if self.stream is None:
                self.stream = triton.runtime.driver.active.get_current_stream
            b = self.base + off * 8
            # JITFunction.run's own last step, with no launch hooks (so no launch metadata)
            e.launcher(e.grid, 1, 1, self.stream(e.dev), e.function, *e.metadata,
                       ptr, e.aptr, b + e.ni * 8, b, b + (e.ni + e.nf) * 8, *e.tail)
        else:
            self._launch_jit(e, t, off)
        self.items.append((tag, e, len(self.chunks) - 1, off, t, (t != 0).any(dim=1) if e.extra else None))
        return True

    def _entry(self, t: torch.Tensor) -> _Entry:
        e = _Entry()
        shape, dev = tuple(t.shape), t.get_device()
        e.dev, e.ck = dev, None
        e.why = unsupported_reason(shape, t.dtype, t.element_size(), True, 0,
                                   device_cc(t.device) if t.is_cuda else (9, 0))
        if not e.why:
            [p], e.ni, nf, nt = plan([torch.empty(shape, dtype=t.dtype, device="meta")], self.k, _nsm(t.device),
                                     **self.knobs)
            e.nf = (nf + 1) // 2
            e.words = e.ni + e.nf + (nt + 1) // 2            # even: every batch offset 16-byte aligned
            e.sign = sign_table(self.seed, self.k, p["kp"], t.device)
            e.aptr = e.sign.data_ptr()
            meta = buffers(e.ni, nf, nt, "meta")
            [(e.kern, grid, args, e.kw)] = calls([p], meta, self.seed, self.k, self.knobs, self.skip,
                                                 signs=lambda kp: e.sign)
            e.grid, e.ints = grid[0], tuple(args[5:])
            e.tail = e.ints + constexpr_args(e.kern, len(args), e.kw)
            e.extra = len(shape) == 2 and not p["flags"]      # token rows by torch (width not k * 128)
            # the device combine's descriptor, less the item's place: [ni, nf, programs, kp, token rows]
            e.drow = (e.ni, e.nf, p["nprog"], p["kp"], shape[0] if p["flags"] else 0)
            del p["t"]
            e.p = p
        self.entries[(t.shape, t.dtype, dev)] = e
        return e

    def _launch_jit(self, e: _Entry, t: torch.Tensor, off: int) -> None:
        """A launch through JITFunction.run (tensor arguments); keeps the CompiledKernel it returns."""
        buf = self.buf[off:off + e.words]
        ipart, fpart, flags = split_buffer(buf, e.ni, 2 * e.nf)
        ck = e.kern[(e.grid,)](t.view(-1).view(torch.int32), e.sign, fpart, ipart, flags, *e.ints, **e.kw)
        if self.direct and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
            e.launcher, e.metadata = launch_of(ck)
            e.function = ck.function
            e.ck = ck          # held: its module stays loaded

    def _new_buffer(self, need: int, device) -> None:
        if self.chunks:
            self.chunks[-1][1] = self.used
        want = max(need, self.CHUNK, _WANT.get(device, 0), 2 * self.cap)
        free = _FREE.get(device)
        buf = free.pop() if free and free[-1].numel() >= want else None
        if buf is None:
            buf = torch.empty(want, dtype=torch.int64, device=device)
        buf.zero_()                     # the token flags; the partials are all written
        self.chunks.append([buf, 0])
        self.buf, self.base, self.cap, self.used = buf, buf.data_ptr(), buf.numel(), 0

    def read(self, only=None) -> None:
        """Combine every launch (``only``: the ids of the tags still wanted; the others are never
        read, e.g. those queued after a collective that never completed) into ``tag.fp``: on the
        device (``_combine_kernel``) with one small copy, or, where it is not used, on the host
        from a copy of every partial."""
        items = self.items if only is None else [it for it in self.items if id(it[0]) in only]
        if self.chunks:
            self.chunks[-1][1] = self.used
        if items:
            res = None if self.host_combine else self._combine_launch(items)
            if res is None:
                self._read_host(items)
            else:
                self._format(items, self._to_host(res))
        if only is None:
            self._give_back()
        else:      # a partial read (a blocked stream): kernels queued behind it may still write
            self.drop()
        self.items = []

    def _combine_launch(self, items):
        """Queue the device combine of items on the current stream (no sync): their descriptors go
        up in one copy from pinned memory, one launch reduces them; returns the device tensor the
        one copy brings back (result rows, bitmaps, torch-side row flags), or None when the device
        combine is not available (COMBINE_WHY says why; the host combines from then on)."""
        m, row = len(items), RES + self.k
        base_t = self.chunks[0][0]
        dev = base_t.device
        base = base_t.data_ptr()
        caddr = [(b.data_ptr() - base) // 8 for b, _ in self.chunks]
        st = _COMBINE.get(dev)
        if st is None or st[0].shape[0] < m:
            cap = max(m, 256)
            pin = torch.empty((cap, DESC), dtype=torch.int64, pin_memory=dev.type == "cuda")
            st = _COMBINE[dev] = [pin, torch.empty((cap, DESC), dtype=torch.int64, device=dev), pin.numpy(), None]
        at, bw, kp_max, rows = 2 * m * row, 0, 0, []
        for i, it in enumerate(items):
            ni, nf, n, kp, ntok = it[1].drow
            w = caddr[it[2]] + it[3]
            rows.append((w, 2 * (w + ni), 2 * (w + ni + nf), n, kp, ntok, i * row, at + bw))
            bw += -(-ntok // 32)
            if kp > kp_max:
                kp_max = kp
        st[2][:m] = rows
        words = m * row + (bw + 1) // 2
        out = st[3]
        if out is None or out.numel() < words:
            out = st[3] = torch.empty(max(words, 4096), dtype=torch.int64, device=dev)
        desc = st[1][:m]
        desc.copy_(st[0][:m], non_blocking=True)
        try:
            self._combine_run(desc, base_t, out, m, kp_max, dev)
        except Exception as ex:        # noqa: BLE001 - said once, and the host combines
            COMBINE_WHY.append(f"device combine unavailable ({type(ex).__name__}: {ex}); combining on the host")
            self.host_combine = True
            return None
        extra = [it[5].to(torch.int64) for it in items if it[5] is not None]
        return torch.cat([out[:words], *extra]) if extra else out[:words]

    def _combine_run(self, desc, base_t, out, m: int, kp_max: int, dev) -> None:
        key = (dev, combine_cb(kp_max))
        c = _COMBINE_CK.get(key)
        if c is not None and self.direct:
            launcher, function, middle, tail = c[:4]
            if self.stream is None:
                self.stream = triton.runtime.driver.active.get_current_stream
            b, o = base_t.data_ptr(), out.data_ptr()
            launcher(m, 1, 1, self.stream(dev.index), function, *middle,
                     desc.data_ptr(), b, b, b, o, o, o, self.k, *tail)
            return
        # the views below are 4 aten ops: built only for a launch through JITFunction.run
        kern, grid, args, kw = combine_call(desc, base_t, out, m, self.k, kp_max)
        ck = kern[grid](*args, **kw)
        if self.direct and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
            launch, middle = launch_of(ck)
            _COMBINE_CK[key] = (launch, ck.function, middle, constexpr_args(kern, len(args), kw), ck)

    def _format(self, items, host: np.ndarray) -> None:
        """The fingerprints from the device combine's copied results: formatting only."""
        m, row, seed = len(items), RES + self.k, self.seed
        r = host[:m * row].reshape(m, row)
        hx = r[:, :2].astype(">u8").tobytes().hex()         # the bit hashes, 32 digits each
        nans, infs = r[:, 2].tolist(), r[:, 3].tolist()
        fl = r[:, 4:].view(np.float64)
        sumsq, absmax, sk = fl[:, 0].tolist(), fl[:, 1].tolist(), fl[:, 2:].tolist()
        bm = host[m * row:].tobytes().hex()                 # the bitmaps (2 digits a byte), then the rest
        at, xo, xat = 0, 0, 0
        if any(it[5] is not None for it in items):     # torch-side row flags: after the bitmaps
            xat = m * row + (sum(-(-it[1].drow[4] // 32) for it in items) + 1) // 2
        isfinite, Fp = math.isfinite, F.Fingerprint
        for i, it in enumerate(items):
            e = it[1]
            p, ntok = e.p, e.drow[4]
            if ntok:
                rows = bm[at:at + 2 * ((ntok + 7) // 8)]
                at += 8 * -(-ntok // 32)
            elif it[5] is not None:
                n = it[5].numel()
                rows = _bitmap_hex_np(host[xat + xo:xat + xo + n].astype(bool))
                xo += n
            else:
                rows = ""
            s, a, n_nan, n_inf = sumsq[i], absmax[i], nans[i], infs[i]
            if not (isfinite(s) and isfinite(a)):
                s, a, n_nan, n_inf = _exact_nonfinite(p, s, a, n_nan, n_inf, it[4])
            # positional: shape, dtype, bit_hash, sketch, sumsq, absmax, n_nan, n_inf, row_nonzero, seed
            it[0].fp = Fp(list(p["shape"]), p["dtype_s"], hx[32 * i:32 * i + 32], sk[i], s, a, n_nan, n_inf, rows,
                          seed)

    def _read_host(self, items) -> None:
        """The host combine: every partial copied (one copy), ``combine_many`` per shape."""
        starts, at = [], 0
        for _, used in self.chunks:
            starts.append(at)
            at += used
        parts = [b[:used] for b, used in self.chunks]
        xoff = {}
        for i, it in enumerate(items):
            if it[5] is not None:
                parts.append(it[5].to(torch.int64))
                xoff[i] = at
                at += it[5].numel()
        host = self._to_host(parts[0] if len(parts) == 1 else torch.cat(parts))   # the one copy
        groups: dict = {}
        for i, (_, e, ci, off, _, _) in enumerate(items):
            g = groups.get(id(e))
            if g is None:
                g = groups[id(e)] = (e, [], [])
            g[1].append(starts[ci] + off)
            g[2].append(i)
        hf, hflag = host.view(np.float32), host.view(np.int32)
        for e, offs, idx in groups.values():
            o = np.asarray(offs, dtype=np.int64)
            extra = [host[xoff[i]:xoff[i] + e.p["shape"][0]].astype(bool) if i in xoff else None for i in idx]
            fps = combine_many(e.p, host, hf, hflag, o, 2 * (o + e.ni), 2 * (o + e.ni + e.nf), self.seed,
                               self.k, rows_extra=extra, tensors=[items[i][4] for i in idx])
            for i, fp in zip(idx, fps):
                items[i][0].fp = fp

    def _to_host(self, dev: torch.Tensor) -> np.ndarray:
        if not dev.is_cuda:
            return dev.numpy()
        d = dev.get_device()
        pin = _PINNED.get(d)
        if pin is None or pin.numel() < dev.numel():
            pin = _PINNED[d] = torch.empty(max(dev.numel(), self.CHUNK), dtype=torch.int64, pin_memory=True)
        h = pin[:dev.numel()]
        h.copy_(dev, non_blocking=True)
        current_stream(d).synchronize()      # the kept Stream: torch's lookup is ~40 us of Python
        return h.numpy()

    def _give_back(self) -> None:
        """The buffers go back for the next batch (read: every kernel writing them has finished)."""
        if self.chunks:
            dev = self.chunks[0][0].device
            _WANT[dev] = sum(used for _, used in self.chunks)
            if len(self.chunks) == 1:
                _FREE.setdefault(dev, [])[:] = [self.chunks[0][0]]
        self.chunks, self.buf, self.base, self.cap, self.used = [], None, 0, 0, 0

    def drop(self) -> None:
        """The stream stayed blocked (a dead peer's collective): nothing is read, and the buffers
        are not reused (kernels queued behind the collective may still write them)."""
        self.items, self.chunks, self.buf, self.base, self.cap, self.used = [], [], None, 0, 0, 0


def constexpr_args(kern, npos: int, kw: dict) -> tuple:
    """The values after the npos positional arguments of a launch, in the kernel's parameter
    order (its constexprs, from kw or their defaults): what JITFunction.run hands the launcher."""
    if _INTERP:
        return ()
    params = inspect.signature(kern.fn).parameters
    return tuple(kw[n] if n in kw else params[n].default for n in kern.arg_names[npos:])
