"""What a launch needs from a tensor's shape and dtype: the capability gate, the plan, the buffers, the calls."""
from __future__ import annotations

import math

import numpy as np
import torch
import triton

from ...config.knobs import knob_int
from .. import definition as fpdef
from .kernels import DTYPE_CODE, INTERP, fp16_kernel, fp32_kernel
from .state import STATE

# 16-bit tensors need sm_90's max.u16x2 (PTX ISA 8.0); the fp32 kernel builds from sm_80 on
MIN_CC = {torch.bfloat16: (9, 0), torch.float16: (9, 0), torch.float32: (8, 0)}


def unsupported_reason(shape, dtype, element_size: int, contiguous: bool, data_ptr: int,
                       cc: tuple) -> str:
    """Why a tensor of this layout takes the torch path on a GPU of compute capability ``cc``
    ("" when the fused kernel takes it)."""
    n = math.prod(shape)
    if dtype not in DTYPE_CODE:
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


def device_cc(device, state=STATE) -> tuple:
    d = torch.device(device).index or 0
    if d not in state.cc:
        state.cc[d] = torch.cuda.get_device_capability(d)
    return state.cc[d]


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and not unsupported_reason(tuple(t.shape), t.dtype, t.element_size(), t.is_contiguous(),
                                                t.data_ptr(), device_cc(t.device))


def padded_k(k: int, dtype) -> int:
    """The sketch columns a kernel computes for k: the fp32 kernel's dot needs N >= 16; the 16-bit
    kernel only needs the 4 row-sign copies."""
    return max(16 if dtype == torch.float32 else 4, triton.next_power_of_2(k))


def sign_table(seed: int, k: int, kp: int, device, state=STATE) -> torch.Tensor:
    """[128, kp] float32 column signs a_j(c), zero columns past k."""
    key = (seed, k, kp, str(device))
    v = state.signs.get(key)
    if v is None:
        a = torch.zeros(fpdef.SKETCH_ROW, kp, dtype=torch.float64)
        a[:, :k] = fpdef.column_signs(seed, k)
        v = state.signs[key] = a.to(device, torch.float32).contiguous()
    return v


def multiprocessors(device, state=STATE) -> int:
    if torch.device(device).type != "cuda":
        return 2
    d = torch.device(device).index or 0
    if d not in state.nsm:
        state.nsm[d] = torch.cuda.get_device_properties(d).multi_processor_count
    return state.nsm[d]


def tuning(block_r=None, num_warps=None, progs_per_sm=None, maxnreg=None, split=None, depth=None) -> dict:
    """The 16-bit kernel's schedule (never its result): arguments, else the TPPROBE_FP_* knobs."""
    return dict(block_r=block_r or knob_int("TPPROBE_FP_BLOCK_R"),
                num_warps=num_warps or knob_int("TPPROBE_FP_WARPS"),
                progs_per_sm=progs_per_sm or knob_int("TPPROBE_FP_PROGS"),
                maxnreg=maxnreg if maxnreg is not None else knob_int("TPPROBE_FP_MAXNREG"),
                split=split or knob_int("TPPROBE_FP_SPLIT"),
                depth=depth or knob_int("TPPROBE_FP_DEPTH"))


def plan(tensors, k: int, nsm: int, block_r: int, progs_per_sm: int, **_) -> tuple[list, int, int, int]:
    """Per tensor: the sizes launch() passes its kernel; and the partial buffers' sizes
    (int64 words, float32 words, token flags).  Needs only shape, dtype and element size, so the
    CI test (tests/unit/test_kernel_compile.py) plans meta tensors of any size exactly as launch() does."""
    plans = []
    foff = ioff = ntok = 0
    for t in tensors:
        kp = padded_k(k, t.dtype)
        n = t.numel()
        nwords = n * t.element_size() // 4
        nbrows = -(-n // fpdef.SKETCH_ROW)
        br = block_r if t.dtype != torch.float32 else 16
        ntiles = -(-nbrows // br)
        nprog = max(1, min(ntiles, progs_per_sm * nsm))
        flags = t.dim() == 2 and t.shape[1] % fpdef.SKETCH_ROW == 0 and t.shape[1] > 0
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
    [p], ni, nf, nt = plan([torch.empty(tuple(shape), dtype=dtype, device="meta")], k, multiprocessors(device),
                           **knobs)
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


def divmagic(d: int) -> tuple[int, int]:
    """(m, s) with n // d == umulhi(n, m) >> s for every 0 <= n < 2^31 (m as the int32 of its
    bits); (0, 0) for d == 1."""
    if d == 1:
        return 0, 0
    lg = (d - 1).bit_length()
    m = (1 << (31 + lg)) // d + 1          # < 2^32; passed as the int32 of the same bits
    return m - (1 << 32) if m >= 1 << 31 else m, lg - 1


def calls(plans, bufs, seed: int, k: int, tune: dict, signs=None):
    """(kernel, grid, args, kwargs) of each launch, in order.  ``signs(kp)`` gives the column-sign
    matrix (a device tensor in launch(); anything with a data_ptr in the compile test)."""
    _, ipart, fpart, flagbuf = bufs
    salt = fpdef.row_salts(seed, 1)[0]
    out = []
    for p in plans:
        t = p["t"]
        words = t.view(-1).view(torch.int32)
        flag = flagbuf[p["toff"]:] if p["flags"] else flagbuf
        bpt = (t.shape[1] // fpdef.SKETCH_ROW) if p["flags"] else 1
        a = signs(p["kp"])
        if t.dtype == torch.float32:
            out.append((fp32_kernel, (p["nprog"],),
                        (words, a, fpart[p["foff"]:], ipart[p["ioff"]:], flag, p["nwords"], p["nbrows"], bpt,
                         -(-p["ntiles"] // p["nprog"]), salt, p["nprog"]),
                        dict(BLOCK_R=p["br"], KP=p["kp"], DO_FLAGS=p["flags"], num_warps=4)))
            continue
        kw = {"maxnreg": tune["maxnreg"]} if tune["maxnreg"] and not INTERP else {}
        out.append((fp16_kernel, (p["nprog"],),
                    (words, a, fpart[p["foff"]:], ipart[p["ioff"]:], flag, p["nwords"], p["nbrows"],
                     p["nwords"] // (p["br"] * 64), p["ntiles"], salt, p["nprog"], *divmagic(bpt)),
                    dict(DT=DTYPE_CODE[t.dtype], BR=p["br"], KP=p["kp"],
                         DO_FLAGS=p["flags"], SPLIT=tune["split"], DEPTH=tune["depth"], SKIP=0,
                         INTERP=INTERP, num_warps=tune["num_warps"], **kw)))
    return out


def launch_one(p: dict, t: torch.Tensor, ipart, fpart, flagbuf, seed: int, k: int, knobs: dict) -> None:
    """One kernel launch writing tensor t's partials at plan p's offsets (no allocation, no sync:
    the token-flag words must be zero before, which the caller does once per batch)."""
    for kern, grid, args, kw in calls([dict(p, t=t)], (None, ipart, fpart, flagbuf), seed, k, knobs,
                                      signs=lambda kp: sign_table(seed, k, kp, t.device)):
        kern[grid](*args, **kw)
