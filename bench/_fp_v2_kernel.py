"""The previous 16-bit fingerprint kernel (v2, commit 48d4c89), frozen here ONLY for the
benchmark's side-by-side "before" row (bench/fingerprint_gpu.py).  It computes the previous
hash and sketch definitions (64-bit lanes, 32 row-sign bits), so its results are not compared
with anything: only its time is.  tpprobe itself uses tpprobe/exchange/_triton_fingerprint.py."""
import torch
import triton
import triton.language as tl

from tpprobe.exchange import _hashdef as F
from tpprobe.exchange._triton_fingerprint import _mix_a, QA, SA


@triton.jit
def _tile16(w, t, m, rows, acc_a, acc_b, acc_sq, acc_mx, zacc, zrt, flag_ptr, nbrows, brows_per_token,
            salt_b0, salt_b1,
            DT: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr, NV: tl.constexpr, KP: tl.constexpr,
            DO_FLAGS: tl.constexpr, F32DOT: tl.constexpr, MASKED: tl.constexpr):
    # one tile of BR sign rows x BW words, laid out [BR, NV, 4] (4 contiguous words per thread)
    r3 = tl.arange(0, BR)[:, None, None]
    v3 = tl.arange(0, NV)[None, :, None]
    e3 = tl.arange(0, 4)[None, None, :]
    q = (t * (BR * BW)).to(tl.uint32) + (r3 * BW + v3 * 4 + e3).to(tl.uint32)
    # hash: one mixer per word; lane b re-weighs it by the odd factor 2q+1 (mod 2^32)
    h = _mix_a(w ^ (q * tl.cast(QA, tl.uint32) + tl.cast(SA, tl.uint32)))
    if MASKED:
        h = tl.where(m, h, tl.zeros_like(h))
    hb = h * (q * 2 + 1)
    acc_a += tl.sum(h.to(tl.uint64), axis=2)
    acc_b += tl.sum(hb.to(tl.uint64), axis=2)
    # stats on the fp32 values (exact for bf16/fp16); NaN/Inf only through the totals
    if DT == 0:
        fl = (w << 16).to(tl.float32, bitcast=True)
        fh = (w & tl.cast(0xFFFF0000, tl.uint32)).to(tl.float32, bitcast=True)
    else:
        fl = w.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        fh = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    acc_sq += tl.sum(fl * fl + fh * fh, axis=2)
    acc_mx = tl.maximum(acc_mx, tl.max(tl.maximum(tl.abs(fl), tl.abs(fh)), axis=2))
    if DO_FLAGS:
        nzr = tl.max(tl.max(w & tl.cast(0x7FFF7FFF, tl.uint32), axis=2), axis=1)
        fm = nzr != 0
        if MASKED:
            fm = fm & (rows < nbrows)
        tl.store(flag_ptr + rows // brows_per_token, tl.full([BR], 1, tl.int32), mask=fm)
    # sketch: Z[j, c] += sum_r b_j(r) x[r, c] on the tensor cores (+-1 row signs, exact products)
    r32 = rows.to(tl.uint32)
    j = tl.arange(0, KP)
    h0 = _mix_a(r32 ^ salt_b0)
    if KP > 32:
        h1 = _mix_a(r32 ^ salt_b1)
        hsel = tl.where((j < 32)[:, None], h0[None, :], h1[None, :])
    else:
        hsel = tl.broadcast_to(h0[None, :], (KP, BR))
    sbit = ((hsel >> (j % 32).to(tl.uint32)[:, None]) << 15) & tl.cast(0x8000, tl.uint32)
    if DT == 0:
        bt = (sbit | tl.cast(0x3F80, tl.uint32)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        lo = w.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (w >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        bt = (sbit | tl.cast(0x3C00, tl.uint32)).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = w.to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    x = tl.reshape(tl.join(lo, hi), (BR, 2 * BW))
    if F32DOT:   # the CPU interpreter mishandles 16-bit dots
        zacc += tl.dot(bt.to(tl.float32), x.to(tl.float32), zrt, input_precision="ieee")
    else:
        # fresh partial (acc = a runtime zero, so it is not fused into zacc): two-level sums
        zacc += tl.dot(bt, x, zrt)
    return acc_a, acc_b, acc_sq, acc_mx, zacc


@triton.jit
def _fp16_kernel(w_ptr, at_ptr, fpart_ptr, ipart_ptr, flag_ptr,
                 nwords, nbrows, brows_per_token, nfull, ntiles, salt_b0, salt_b1, fzero,
                 DT: tl.constexpr, BW: tl.constexpr, BR: tl.constexpr, KP: tl.constexpr,
                 NPROG: tl.constexpr, DO_FLAGS: tl.constexpr, F32DOT: tl.constexpr):
    """16-bit tensors: grid-stride over tiles of BR sign rows; full tiles unmasked with the next
    tile prefetched into registers, the one partial tile (if any) masked.  Per-thread
    accumulators; one reduction per program at the end."""
    pid = tl.program_id(0)
    NV: tl.constexpr = BW // 4
    sb0 = tl.cast(salt_b0, tl.uint32)
    sb1 = tl.cast(salt_b1, tl.uint32)
    r3 = tl.arange(0, BR)[:, None, None]
    v3 = tl.arange(0, NV)[None, :, None]
    e3 = tl.arange(0, 4)[None, None, :]
    loc = r3 * BW + v3 * 4 + e3
    rl = tl.arange(0, BR)
    acc_a = tl.zeros([BR, NV], tl.uint64)
    acc_b = tl.zeros([BR, NV], tl.uint64)
    acc_sq = tl.zeros([BR, NV], tl.float32)
    acc_mx = tl.zeros([BR, NV], tl.float32)
    zacc = tl.zeros([KP, 2 * BW], tl.float32)
    zrt = tl.zeros([KP, 2 * BW], tl.float32) + fzero
    tru = loc >= 0
    t = pid
    w = tl.load(w_ptr + (tl.minimum(t, nfull - 1).to(tl.int64) * (BR * BW) + loc),
                mask=tru & (nfull > 0), other=0).to(tl.uint32, bitcast=True)
    for _ in range(pid, nfull, NPROG):
        tn = tl.minimum(t + NPROG, nfull - 1)
        wn = tl.load(w_ptr + (tn.to(tl.int64) * (BR * BW) + loc)).to(tl.uint32, bitcast=True)
        acc_a, acc_b, acc_sq, acc_mx, zacc = _tile16(
            w, t, tru, t * BR + rl, acc_a, acc_b, acc_sq, acc_mx, zacc, zrt, flag_ptr, nbrows,
            brows_per_token, sb0, sb1, DT, BW, BR, NV, KP, DO_FLAGS, F32DOT, False)
        w = wn
        t += NPROG
    if (nfull < ntiles) & (pid == nfull % NPROG):
        t = nfull
        qm = t.to(tl.int64) * (BR * BW) + loc
        m = qm < nwords
        w = tl.load(w_ptr + qm, mask=m, other=0).to(tl.uint32, bitcast=True)
        acc_a, acc_b, acc_sq, acc_mx, zacc = _tile16(
            w, t, m, t * BR + rl, acc_a, acc_b, acc_sq, acc_mx, zacc, zrt, flag_ptr, nbrows,
            brows_per_token, sb0, sb1, DT, BW, BR, NV, KP, DO_FLAGS, F32DOT, True)
    j = tl.arange(0, KP)
    c = tl.arange(0, 2 * BW)
    at = tl.load(at_ptr + j[:, None] * (2 * BW) + c[None, :])
    fbase = fpart_ptr + pid * (KP + 2)
    tl.store(fbase + j, tl.sum(zacc * at, axis=1))
    tl.store(fbase + KP, tl.sum(tl.sum(acc_sq, axis=1), axis=0))
    tl.store(fbase + KP + 1, tl.max(tl.max(acc_mx, axis=1), axis=0))
    ibase = ipart_ptr + pid * 4
    tl.store(ibase, tl.sum(tl.sum(acc_a, axis=1), axis=0).to(tl.int64, bitcast=True))
    tl.store(ibase + 1, tl.sum(tl.sum(acc_b, axis=1), axis=0).to(tl.int64, bitcast=True))
    tl.store(ibase + 2, tl.cast(0, tl.int64))    # NaN/Inf: counted on the host when the totals
    tl.store(ibase + 3, tl.cast(0, tl.int64))    # say so (sumsq not finite or absmax inf)



_AT: dict = {}


def _at(seed, k, kp, device):
    key = (seed, k, kp, str(device))
    if key not in _AT:
        a = torch.zeros(kp, F.SKETCH_ROW, dtype=torch.float64)
        a[:k] = F.column_signs(seed, k).T
        _AT[key] = a.to(device, torch.float32).contiguous()
    return _AT[key]


def launch_v2(tensors, seed=0, k=32, block_r=32, num_warps=4, progs_per_sm=2):
    """Launch v2 on 16-bit tensors (device work only, no host sync)."""
    nsm = torch.cuda.get_device_properties(tensors[0].device).multi_processor_count
    kp = max(32, triton.next_power_of_2(k))
    salts = F.row_salts(seed, 2)
    outs = []
    for t in tensors:
        bw = F.SKETCH_ROW * t.element_size() // 4
        nwords = t.numel() * t.element_size() // 4
        nbrows = -(-t.numel() // F.SKETCH_ROW)
        ntiles = -(-nbrows // block_r)
        nprog = max(1, min(ntiles, progs_per_sm * nsm))
        flags = t.dim() == 2 and t.shape[1] % F.SKETCH_ROW == 0
        fpart = torch.empty(nprog * (kp + 2), dtype=torch.float32, device=t.device)
        ipart = torch.empty(nprog * 4, dtype=torch.int64, device=t.device)
        flag = torch.zeros(t.shape[0] if flags else 1, dtype=torch.int32, device=t.device)
        _fp16_kernel[(nprog,)](
            t.view(-1).view(torch.int32), _at(seed, k, kp, t.device), fpart, ipart, flag,
            nwords, nbrows, (t.shape[1] // F.SKETCH_ROW) if flags else 1,
            nwords // (block_r * bw), ntiles, salts[0], salts[1], 0.0,
            DT=0 if t.dtype == torch.bfloat16 else 1, BW=bw, BR=block_r, KP=kp, NPROG=nprog,
            DO_FLAGS=flags, F32DOT=False, num_warps=num_warps)
        outs.append((fpart, ipart, flag))
    return outs
