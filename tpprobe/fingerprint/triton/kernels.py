"""The fused fingerprint kernels (``@triton.jit`` only): one launch per tensor, one combine per batch.

Each element is read once and everything ``fingerprint.reference._fingerprint_torch`` computes comes
out of one launch per tensor: the word hash's two lanes, the sketch, the sum of squares, max |x| and
the per-token-row non-zero flags.  Each program writes one row of partials; ``combine_kernel`` reduces
a batch's partials on the device (exact integers, float64 sums in program order, one program per
tensor).  The host combine (``combine.combine_many``) adds in the same order, so the same bits.

* 16-bit tensors: ``fp16_kernel``, everything elementwise in registers (see its docstring).
* fp32 tensors: ``fp32_kernel``, the sketch through a tf32-free ``ieee`` dot per tile.

NaN and Inf: the 16-bit kernel counts nothing per element; a NaN makes the sum of squares NaN and
an Inf makes max |x| infinite, and only then does the host take the exact counts.  ``SKIP`` (a
constexpr, 0 in every production launch) leaves stages out for bench/fingerprint_gpu.py --ablate.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import definition as fpdef

INTERP = bool(os.environ.get("TRITON_INTERPRET"))   # Triton's CPU interpreter (tests of the logic)

DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

QA = tl.constexpr(fpdef.QA)
SA = tl.constexpr(fpdef.SA)
QB = tl.constexpr(fpdef.QB)


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
# binary per dtype / k / flags takes every shape (tests/unit/test_kernel_compile.py compiles them all).
# Their loads and stores need no size hints: full tiles are unmasked or masked by a scalar.
@triton.jit(do_not_specialize=["nwords", "nbrows", "nfull", "ntiles", "salt_b0", "NPROG", "bpt_m", "bpt_s"])
def fp16_kernel(w_ptr, a_ptr, fpart_ptr, ipart_ptr, flag_ptr,
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
def fp32_kernel(w_ptr, a_ptr, fpart_ptr, ipart_ptr, flag_ptr, nwords, nbrows, brows_per_token,
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
# A forward's partials are reduced on the device (``combine_kernel``, one program per tensor) into
# one small result buffer, so the host copies ~(6 + k) words and a token bitmap per tensor instead
# of every program's partials, and only formats.  The float sums run over the programs IN ORDER
# (acc = ((0.0 + p0) + p1) + ... + p_{n-1}, float64), which is how the host combine
# (``combine_many``) sums them too, so both give the same fingerprints to the bit.

DESC = 8          # int64 words of an item's descriptor (see combine_kernel)
RES = 6           # int64 words of an item's result before its k sketch values
_RES, _DESC = tl.constexpr(RES), tl.constexpr(DESC)


@triton.jit(do_not_specialize=["K"])
def combine_kernel(desc_ptr, ip_ptr, fp_ptr, gp_ptr, out_ptr, outf_ptr, outg_ptr, K,
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
    # the bit hash's two words: fmix64(la), fmix64(lb ^ 0x5851F42D4C957F2D) (definition.hash_hex)
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
