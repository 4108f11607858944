"""Today's (commit 8b49ec6) host path of a fingerprint launch, frozen ONLY for the benchmark's
side-by-side "before" row (bench/fingerprint_host.py): ``Deferred`` as exchange/fingerprint.py had
it (the dispatch re-checked and the TPPROBE_FP_* knobs read from the environment per tensor, a
fresh partial buffer, the views, ``JITFunction.run`` and a per-item host combine for every
launch) over the SAME kernels (imported from tpprobe).  Its fingerprints must equal the new
path's bit for bit; the bench checks that.  tpprobe itself never imports this file."""
import math
import os

import numpy as np
import torch

from tpprobe.exchange import _hashdef as F
from tpprobe.exchange import _triton_fingerprint as tf
from tpprobe.exchange._triton_fingerprint import (_DT, _INTERP, _fp16_kernel, _fp32_kernel, _kp,  # noqa: F401
                                                  _divmagic, _nonfinite_stats, _nsm, sign_table)
from tpprobe.exchange.fingerprint import _fingerprint_torch, _torch_path


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def tuning(block_r=None, num_warps=None, progs_per_sm=None, maxnreg=None, split=None, depth=None):
    return dict(block_r=block_r or _env("TPPROBE_FP_BLOCK_R", 16),
                num_warps=num_warps or _env("TPPROBE_FP_WARPS", 4),
                progs_per_sm=progs_per_sm or _env("TPPROBE_FP_PROGS", 3),
                maxnreg=maxnreg if maxnreg is not None else _env("TPPROBE_FP_MAXNREG", 144),
                split=split or _env("TPPROBE_FP_SPLIT", 2),
                depth=depth or _env("TPPROBE_FP_DEPTH", 3))


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
        plans.append(dict(t=t, shape=list(t.shape), dtype=t.dtype, kp=kp, br=br, nwords=nwords, nbrows=nbrows,
                          ntiles=ntiles, nprog=nprog, flags=flags, foff=foff, ioff=ioff, toff=ntok))
        # every slice 16-byte aligned: one pointer specialization, whatever the shapes
        foff += -(-nprog * (kp + 2) // 4) * 4
        ioff += nprog * 4
        if flags:
            ntok += -(-t.shape[0] // 4) * 4
    return plans, ioff, foff, ntok


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


def combine_one(p: dict, hi, hf, hflag, seed: int, k: int, rows_extra=None, tensor=None) -> F.Fingerprint:
    """The host combine of one tensor's partials (exact integers, float64) from the copied batch
    buffer (numpy views: int64 partials hi, float32 partials hf, int32 token flags hflag).  A
    16-bit tensor with NaN / Inf gets its exact counts from `tensor` when it is still there;
    without it (a CUDA-graph tap reads after replay) the counts say at least one."""
    kp, n = p["kp"], p["nprog"]
    fp = hf[p["foff"]:p["foff"] + n * (kp + 2)].reshape(n, kp + 2).astype(np.float64)
    ip = hi[p["ioff"]:p["ioff"] + n * 4].reshape(n, 4)
    la = int(ip[:, 0].sum()) & F.M32                 # partials < 2^32: exact in int64
    lb = int(np.bitwise_xor.reduce(ip[:, 1])) & F.M32
    rows = ""
    if p["flags"]:
        rows = _bitmap_hex_np(hflag[p["toff"]:p["toff"] + p["shape"][0]] > 0)
    elif rows_extra is not None:
        rows = _bitmap_hex_np(rows_extra)
    # the float sums over the programs in order (numpy sums axis 0 row by row), the combine's
    # definition since the device combine (this file once took the sum of squares as numpy sums a
    # 1-D array: pairwise)
    acc = fp[:, :kp + 1].sum(0)
    sumsq, absmax = float(acc[kp]), float(fp[:, kp + 1].max())
    n_nan, n_inf = int(ip[:, 2].sum()), int(ip[:, 3].sum())
    if p["dtype"] != torch.float32 and not (math.isfinite(sumsq) and math.isfinite(absmax)):
        if tensor is not None:
            sumsq, absmax, n_nan, n_inf = _nonfinite_stats(tensor)
        else:      # lower bounds: a NaN makes the sum of squares NaN, an Inf max |x| infinite
            n_nan, n_inf = int(math.isnan(sumsq)), int(math.isinf(absmax))
    return F.Fingerprint(
        shape=list(p["shape"]), dtype=str(p["dtype"]).replace("torch.", ""),
        bit_hash=F.hash_hex(la, lb), sketch=acc[:k].tolist(),
        sumsq=sumsq, absmax=absmax, n_nan=n_nan, n_inf=n_inf, row_nonzero=rows, seed=seed)


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


def _triton_ok(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    if os.environ.get("TPPROBE_FINGERPRINT_TORCH"):
        _torch_path("TPPROBE_FINGERPRINT_TORCH is set")
        return False
    try:
        from tpprobe.exchange import _triton_fingerprint as tf  # noqa: F811
    except Exception as e:
        _torch_path(f"triton does not import ({type(e).__name__})")
        return False
    why = tf.unsupported_reason(tuple(t.shape), t.dtype, t.element_size(), t.is_contiguous(), t.data_ptr(),
                                tf.device_cc(t.device))
    if why:
        _torch_path(why)
    return not why


class Pending:
    """A fingerprint launched on the GPU and not read yet (``Deferred.resolve`` fills ``fp``)."""
    __slots__ = ("fp",)

    def __init__(self):
        self.fp = None


class Deferred:
    """Fingerprints for a whole forward with no host sync inside it: each CUDA tensor's kernels
    are queued on the current stream when it is captured (stream order keeps the in-place
    all-reduce from overwriting an input before it is read), and ``resolve()`` reads every
    launch's partials with ONE device-to-host copy after the forward.  Tensors the fused kernel
    does not take (CPU, odd layouts, pre-Hopper 16-bit) are fingerprinted at once."""

    def __init__(self, seed: int, k: int):
        self.seed, self.k = seed, k
        self.items: list = []

    def __call__(self, t: torch.Tensor):
        if not _triton_ok(t):
            return _fingerprint_torch(t, self.seed, self.k)
        finish, _ = launch([t.detach()], self.seed, self.k)
        ph = Pending()
        self.items.append((ph, finish))
        return ph

    def resolve(self, only=None) -> None:
        """Read every launch (``only``: the ids of the Pendings still wanted; the others are never
        read, e.g. those computed after a collective that never completed)."""
        if only is not None:
            self.items = [(ph, fin) for ph, fin in self.items if id(ph) in only]
        if not self.items:
            return
        parts = [p for _, fin in self.items for p in fin.parts]
        host = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()   # the one copy
        i = 0
        for ph, fin in self.items:
            chunk, off = [], i
            for p in fin.parts:
                chunk.append(host[off:off + p.numel()])
                off += p.numel()
            i = off
            ph.fp = fin(chunk)[0]
        self.items = []

    def drop(self) -> None:
        """The stream stayed blocked (a dead peer's collective): never read these."""
        self.items = []
