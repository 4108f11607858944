"""A forward's fused fingerprints: `Batch` queues one launch per tensor and reads them all with one copy.

What one launch needs besides the tensor's address depends only on its shape, dtype and device and
on (seed, k, knobs): the plan, the grid, the integer arguments, the sign table.  `Batch` keeps them
per shape (an `Entry`, built once per process in `State.entries`) and lays every launch's partials
out in one device buffer per forward (zeroed once: the token flags need it), so a launch is the
kernel launch and nothing else (fastlaunch.py: the direct launch after a shape's first)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import triton

from ...config.knobs import knob_set
from ...core.cuda import current_stream
from .. import definition as fpdef
from . import fastlaunch, native
from .combine import bitmap_hex, combine_call, combine_cb, combine_many, combine_one, exact_nonfinite
from .kernels import DESC, RES
from .plan import (buffers, calls, device_cc, multiprocessors, plan, sign_table, split_buffer, tuning,
                   unsupported_reason)
from .state import STATE, State


@dataclass(slots=True)
class Entry:
    """One (shape, dtype, device)'s launch, built at its first tensor."""
    why: str = ""                # why the fused kernel does not take it ("": it does)
    p: Optional[dict] = None     # its plan (plan.plan, without the tensor)
    dev: int = -1                # device index
    kern: Any = None
    grid: int = 0
    ints: tuple = ()             # the integer arguments after the 5 pointers
    kw: Optional[dict] = None    # the launch's keyword arguments (constexprs, num_warps, ...)
    tail: tuple = ()             # ints + the constexprs, as the launcher takes them
    sign: Optional[torch.Tensor] = None     # the column-sign table, and its address
    aptr: int = 0
    ni: int = 0                  # int64 words of its int partials
    nf: int = 0                  # int64 words of its float32 partials
    words: int = 0               # int64 words of its slice of the batch buffer (even)
    fbyte: int = 0               # byte offsets of its float partials and token flags in its slice
    tbyte: int = 0
    extra: bool = False          # token-row flags by torch (a 2-D width that is not k * 128)
    nprog: int = 0               # programs (partial rows)
    kp: int = 0                  # sketch columns per partial row
    ntok: int = 0                # token rows the kernel flags (0: none)
    direct: Optional[fastlaunch.DirectLaunch] = None    # set after its first launch, where taken
    native: Any = None           # its launch from C (native.py), set with ``direct`` where taken


class Item(fpdef.Pending):
    """One queued launch, and the Pending its read fills (``fp``; also ``tag.fp`` where a tag was given)."""
    __slots__ = ("tag", "entry", "chunk", "off", "tensor", "rows")

    def __init__(self, tag, entry: Entry, chunk: int, off: int, tensor: Optional[torch.Tensor],
                 rows: Optional[torch.Tensor]):
        self.fp = None
        self.tag = tag               # None: the Item is the Pending (`Batch.take`)
        self.entry = entry
        self.chunk = chunk           # which of the batch's buffers
        self.off = off               # its word offset there
        self.tensor = tensor
        self.rows = rows             # torch-side token-row flags (Entry.extra), else None

    def fill(self, fp) -> None:
        self.fp = fp
        if self.tag is not None:
            self.tag.fp = fp


@dataclass(slots=True)
class Staging:
    """The device combine's descriptor upload (pinned host rows, the device copy) and result buffer."""
    pinned: torch.Tensor
    device: torch.Tensor
    host: np.ndarray
    out: Optional[torch.Tensor] = None
    # what the descriptors on the device describe: (chunk word offsets, (entry, chunk, offset) per
    # launch) and what the launch needs besides them (words, kp_max). A decode forward queues the same
    # launches at the same offsets every time: then nothing is built or uploaded again
    key: Any = None
    words: int = 0
    kp_max: int = 0
    view: Any = None             # (out, words, out[:words]): the slice the one copy reads, made once


class Batch:
    """One forward's fused fingerprints: ``add`` queues one tensor's kernel on the current stream
    (no sync; no allocation but the batch's first), ``read`` combines every launch's partials on
    the device (one descriptor upload, one ``combine_kernel`` launch) and brings the results to
    the host with ONE small device-to-host copy (or, with the host combine, copies every partial
    and combines them with ``combine_many``, per shape).  The TPPROBE_FP_* knobs are read once,
    here.  What outlives the batch (entries, buffers given back) is in ``state``."""

    CHUNK = 1 << 16          # int64 words of a batch's first partials buffer (512 KiB) at least

    def __init__(self, seed: int, k: int, knobs=None, host_combine=None, state: State = STATE):
        self.seed, self.k, self.state = seed, k, state
        # the combine: on the device (one small copy per read) unless TPPROBE_FP_HOST_COMBINE=1
        # or the device combine failed once in this process
        if host_combine is None:
            host_combine = knob_set("TPPROBE_FP_HOST_COMBINE") or bool(state.combine_why)
        self.host_combine = host_combine
        self.knobs = tuning() if knobs is None else knobs
        self.entries = state.entries.setdefault((seed, k, tuple(sorted(self.knobs.items()))), {})
        self.direct = fastlaunch.direct_launch_ok()    # per batch: a hook a profiler adds takes effect
        if self.direct:
            native.load()                     # built once per process (a later Deferred's calls go to C)
        self.stream = None                    # the driver's current-stream getter, at the first launch
        self.items: list[Item] = []
        self.later: list[Item] = []   # queued by ``take(later=True)``: launched by ``read``, first
        self.chunks: list = []   # [device buffer, words used]
        self.buf = None
        self.base = self.cap = self.used = 0
        self.chunk = -1                       # the index of the buffer in use (len(chunks) - 1)

    def add(self, t: torch.Tensor, tag) -> bool:
        """Queue t's kernel (its fingerprint goes to ``tag.fp`` on ``read``); False, with nothing
        queued, when the fused kernel does not take t (``unsupported_reason`` says why)."""
        it = self.take(t)
        if it is None:
            return False
        it.tag = tag
        return True

    def take(self, t: torch.Tensor, later: bool = False) -> Optional[Item]:
        """Queue t's kernel; the queued Item is a Pending whose ``fp`` the read fills. None, with
        nothing queued, when the fused kernel does not take t (``unsupported_reason`` says why).
        later=True: t is the caller's own (a copy, a sum it made) and nothing writes it again, so its
        slot is laid out now and its kernel launched by ``read`` with the others so queued, one after
        another, rather than here, between the model's ops."""
        e = self.entries.get((t.shape, t.dtype, t.get_device()))
        if e is None:
            e = self.entry(t)
        ptr = t.data_ptr()
        if e.why or ptr % 16 or not t.is_contiguous():
            return None
        off = self.used
        if off + e.words > self.cap:
            self._new_buffer(e.words, t.device)
            off = 0
        self.used = off + e.words
        if later:
            it = Item(None, e, self.chunk, off, t, None)
            self.later.append(it)
        else:
            self._launch(e, t, ptr, self.buf, self.base, off)
            it = Item(None, e, self.chunk, off, t, (t != 0).any(dim=1) if e.extra else None)
        self.items.append(it)
        return it

    def _launch(self, e: Entry, t: torch.Tensor, ptr: int, buf: torch.Tensor, base: int, off: int) -> None:
        d = e.direct
        if d is not None and self.direct:
            if self.stream is None:
                self.stream = triton.runtime.driver.active.get_current_stream
            b = base + off * 8
            # JITFunction.run's own last step, with no launch hooks (so no launch metadata)
            d.launch(e.grid, 1, 1, self.stream(e.dev), d.function, *d.middle,
                     ptr, e.aptr, b + e.fbyte, b, b + e.tbyte, *e.tail)
        else:
            self._launch_jit(e, t, buf, off)

    def _launch_later(self, items: list[Item]) -> None:
        """The launches ``take(later=True)`` queued, of the items to be read, in one loop (in C where
        every one has a native launch, on one device)."""
        chunks = self.chunks
        nat = native.NATIVE
        if nat is not None and self.direct and items and all(it.entry.native is not None for it in items):
            dev = items[0].entry.dev
            if all(it.entry.dev == dev for it in items):
                if self.stream is None:
                    self.stream = triton.runtime.driver.active.get_current_stream
                nat.launch_later(items, [b.data_ptr() for b, _ in chunks], self.stream(dev))
                return
        for it in items:
            e, t = it.entry, it.tensor
            buf = chunks[it.chunk][0]
            self._launch(e, t, t.data_ptr(), buf, buf.data_ptr(), it.off)
            if e.extra:
                it.rows = (t != 0).any(dim=1)

    def entry(self, t: torch.Tensor) -> Entry:
        """The launch entry of t's (shape, dtype, device), built and kept at its first tensor."""
        e = Entry()
        shape, dev = tuple(t.shape), t.get_device()
        e.dev = dev
        e.why = unsupported_reason(shape, t.dtype, t.element_size(), True, 0,
                                   device_cc(t.device, self.state) if t.is_cuda else (9, 0))
        if not e.why:
            [p], e.ni, nf, nt = plan([torch.empty(shape, dtype=t.dtype, device="meta")], self.k,
                                     multiprocessors(t.device, self.state), **self.knobs)
            e.nf = (nf + 1) // 2
            e.words = e.ni + e.nf + (nt + 1) // 2            # even: every batch offset 16-byte aligned
            e.fbyte, e.tbyte = e.ni * 8, (e.ni + e.nf) * 8
            e.sign = sign_table(self.seed, self.k, p["kp"], t.device, self.state)
            e.aptr = e.sign.data_ptr()
            meta = buffers(e.ni, nf, nt, "meta")
            [(e.kern, grid, args, e.kw)] = calls([p], meta, self.seed, self.k, self.knobs, signs=lambda kp: e.sign)
            e.grid, e.ints = grid[0], tuple(args[5:])
            e.tail = e.ints + fastlaunch.constexpr_args(e.kern, len(args), e.kw)
            e.extra = len(shape) == 2 and not p["flags"]      # token rows by torch (width not k * 128)
            e.nprog, e.kp, e.ntok = p["nprog"], p["kp"], shape[0] if p["flags"] else 0
            del p["t"]
            e.p = p
        self.entries[(t.shape, t.dtype, dev)] = e
        return e

    def _launch_jit(self, e: Entry, t: torch.Tensor, buf: torch.Tensor, off: int) -> None:
        """A launch through JITFunction.run (tensor arguments); keeps the CompiledKernel it returns."""
        buf = buf[off:off + e.words]
        ipart, fpart, flags = split_buffer(buf, e.ni, 2 * e.nf)
        ck = e.kern[(e.grid,)](t.view(-1).view(torch.int32), e.sign, fpart, ipart, flags, *e.ints, **e.kw)
        if self.direct and fastlaunch.launchable(ck):
            launch, middle = fastlaunch.launch_of(ck)
            e.direct = fastlaunch.DirectLaunch(launch, ck.function, middle, (), ck)
            e.native = native.launch_for(e, ck, launch)

    def _new_buffer(self, need: int, device) -> None:
        if self.chunks:
            self.chunks[-1][1] = self.used
        want = max(need, self.CHUNK, self.state.want.get(device, 0), 2 * self.cap)
        free = self.state.free.get(device)
        buf = free.pop() if free and free[-1].numel() >= want else None
        if buf is None:
            buf = torch.empty(want, dtype=torch.int64, device=device)
        buf.zero_()                     # the token flags; the partials are all written
        self.chunks.append([buf, 0])
        self.chunk = len(self.chunks) - 1
        self.buf, self.base, self.cap, self.used = buf, buf.data_ptr(), buf.numel(), 0

    def read(self, only=None) -> None:
        """Combine every launch (``only``: the ids of the tags still wanted; the others are never
        read, e.g. those queued after a collective that never completed) into ``tag.fp``: on the
        device (``combine_kernel``) with one small copy, or, where it is not used, on the host
        from a copy of every partial."""
        def wanted(queued):
            return queued if only is None else [it for it in queued if id(it if it.tag is None else it.tag) in only]
        items = wanted(self.items)
        if self.chunks:
            self.chunks[-1][1] = self.used
        if self.later:
            later, self.later = wanted(self.later), []
            self._launch_later(later)
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

    def _combine_launch(self, items: list[Item]):
        """Queue the device combine of items on the current stream (no sync): their descriptors go
        up in one copy from pinned memory, one launch reduces them; returns the device tensor the
        one copy brings back (result rows, bitmaps, torch-side row flags), or None when the device
        combine is not available (State.combine_why says why; the host combines from then on)."""
        m, row = len(items), RES + self.k
        base_t = self.chunks[0][0]
        dev = base_t.device
        base = base_t.data_ptr()
        caddr = [(b.data_ptr() - base) // 8 for b, _ in self.chunks]
        st = self.state.staging.get(dev)
        if st is None or st.pinned.shape[0] < m:
            cap = max(m, 256)
            pin = torch.empty((cap, DESC), dtype=torch.int64, pin_memory=dev.type == "cuda")
            st = self.state.staging[dev] = Staging(pin, torch.empty((cap, DESC), dtype=torch.int64, device=dev),
                                                   pin.numpy())
        key = (tuple(caddr), tuple([(id(it.entry), it.chunk, it.off) for it in items]))   # entries live in State
        if key != st.key:           # else: the descriptors on the device are these already
            at, bw, kp_max, rows = 2 * m * row, 0, 0, []
            for i, it in enumerate(items):
                e = it.entry
                w = caddr[it.chunk] + it.off
                # the descriptor (combine_kernel): int, float and flag offsets, programs, kp, token rows,
                # result row, bitmap
                rows.append((w, 2 * (w + e.ni), 2 * (w + e.ni + e.nf), e.nprog, e.kp, e.ntok, i * row, at + bw))
                bw += -(-e.ntok // 32)
                if e.kp > kp_max:
                    kp_max = e.kp
            st.key = None           # not valid until the upload is queued
            st.host[:m] = rows
            st.device[:m].copy_(st.pinned[:m], non_blocking=True)
            st.key, st.words, st.kp_max = key, m * row + (bw + 1) // 2, kp_max
        words, kp_max = st.words, st.kp_max
        out = st.out
        if out is None or out.numel() < words:
            out = st.out = torch.empty(max(words, 4096), dtype=torch.int64, device=dev)
        try:
            self._combine_run(st.device, base_t, out, m, kp_max, dev)
        except Exception as ex:        # noqa: BLE001 - said once, and the host combines
            st.key = None
            self.state.combine_why.append(
                f"device combine unavailable ({type(ex).__name__}: {ex}); combining on the host")
            self.host_combine = True
            return None
        view = st.view
        if view is None or view[0] is not out or view[1] != words:
            view = st.view = (out, words, out[:words])
        extra = [it.rows.to(torch.int64) for it in items if it.rows is not None]
        return torch.cat([view[2], *extra]) if extra else view[2]

    def _combine_run(self, desc, base_t, out, m: int, kp_max: int, dev) -> None:
        """The combine of the first m descriptor rows of desc (its address is theirs: the direct
        launch needs no view of them)."""
        key = (dev, combine_cb(kp_max))
        c = self.state.combine_launch.get(key)
        if c is not None and self.direct:
            if self.stream is None:
                self.stream = triton.runtime.driver.active.get_current_stream
            b, o = base_t.data_ptr(), out.data_ptr()
            c.launch(m, 1, 1, self.stream(dev.index), c.function, *c.middle,
                     desc.data_ptr(), b, b, b, o, o, o, self.k, *c.tail)
            return
        # the views below are 5 aten ops: built only for a launch through JITFunction.run
        kern, grid, args, kw = combine_call(desc[:m], base_t, out, m, self.k, kp_max)
        ck = kern[grid](*args, **kw)
        if self.direct and fastlaunch.launchable(ck):
            self.state.combine_launch[key] = fastlaunch.direct_launch(kern, ck, len(args), kw)

    def _format(self, items: list[Item], host: np.ndarray) -> None:
        """The fingerprints from the device combine's copied results: formatting only."""
        m, row, seed = len(items), RES + self.k, self.seed
        r = host[:m * row].reshape(m, row)
        hx = r[:, :2].astype(">u8").tobytes().hex()         # the bit hashes, 32 digits each
        nans, infs = r[:, 2].tolist(), r[:, 3].tolist()
        fl = r[:, 4:].view(np.float64)
        sumsq, absmax, sk = fl[:, 0].tolist(), fl[:, 1].tolist(), fl[:, 2:].tolist()
        bm = host[m * row:].tobytes().hex()                 # the bitmaps (2 digits a byte), then the rest
        at, xo, xat = 0, 0, 0
        if any(it.rows is not None for it in items):     # torch-side row flags: after the bitmaps
            xat = m * row + (sum(-(-it.entry.ntok // 32) for it in items) + 1) // 2
        isfinite, Fp = math.isfinite, fpdef.Fingerprint
        for i, it in enumerate(items):
            e = it.entry
            p, ntok = e.p, e.ntok
            if ntok:
                rows = bm[at:at + 2 * ((ntok + 7) // 8)]
                at += 8 * -(-ntok // 32)
            elif it.rows is not None:
                n = it.rows.numel()
                rows = bitmap_hex(host[xat + xo:xat + xo + n].astype(bool))
                xo += n
            else:
                rows = ""
            s, a, n_nan, n_inf = sumsq[i], absmax[i], nans[i], infs[i]
            if not (isfinite(s) and isfinite(a)):
                s, a, n_nan, n_inf = exact_nonfinite(p, s, a, n_nan, n_inf, it.tensor)
            # positional: shape, dtype, bit_hash, sketch, sumsq, absmax, n_nan, n_inf, row_nonzero, seed
            it.fill(Fp(list(p["shape"]), p["dtype_s"], hx[32 * i:32 * i + 32], sk[i], s, a, n_nan, n_inf, rows, seed))

    def _read_host(self, items: list[Item]) -> None:
        """The host combine: every partial copied (one copy), ``combine_many`` per shape."""
        starts, at = [], 0
        for _, used in self.chunks:
            starts.append(at)
            at += used
        parts = [b[:used] for b, used in self.chunks]
        xoff = {}
        for i, it in enumerate(items):
            if it.rows is not None:
                parts.append(it.rows.to(torch.int64))
                xoff[i] = at
                at += it.rows.numel()
        host = self._to_host(parts[0] if len(parts) == 1 else torch.cat(parts))   # the one copy
        groups: dict = {}
        for i, it in enumerate(items):
            g = groups.get(id(it.entry))
            if g is None:
                g = groups[id(it.entry)] = (it.entry, [], [])
            g[1].append(starts[it.chunk] + it.off)
            g[2].append(i)
        hf, hflag = host.view(np.float32), host.view(np.int32)
        for e, offs, idx in groups.values():
            o = np.asarray(offs, dtype=np.int64)
            extra = [host[xoff[i]:xoff[i] + e.p["shape"][0]].astype(bool) if i in xoff else None for i in idx]
            fps = combine_many(e.p, host, hf, hflag, o, 2 * (o + e.ni), 2 * (o + e.ni + e.nf), self.seed,
                               self.k, rows_extra=extra, tensors=[items[i].tensor for i in idx])
            for i, fp in zip(idx, fps):
                items[i].fill(fp)

    def _to_host(self, dev: torch.Tensor) -> np.ndarray:
        if not dev.is_cuda:
            return dev.numpy()
        d, n = dev.get_device(), dev.numel()
        pin = self.state.pinned.get(d)
        if pin is None or pin.numel() < n:
            pin = self.state.pinned[d] = torch.empty(max(n, self.CHUNK), dtype=torch.int64, pin_memory=True)
        view = self.state.pinned_view.get(d)
        if view is None or view[0] is not pin or view[1] != n:     # a decode forward reads the same n
            h = pin[:n]
            view = self.state.pinned_view[d] = (pin, n, h, h.numpy())
        view[2].copy_(dev, non_blocking=True)
        current_stream(d).synchronize()      # the kept Stream (core/cuda.py)
        return view[3]

    def _give_back(self) -> None:
        """The buffers go back for the next batch (read: every kernel writing them has finished)."""
        if self.chunks:
            dev = self.chunks[0][0].device
            self.state.want[dev] = sum(used for _, used in self.chunks)
            if len(self.chunks) == 1:
                self.state.free.setdefault(dev, [])[:] = [self.chunks[0][0]]
        self.chunks, self.buf, self.base, self.cap, self.used = [], None, 0, 0, 0

    def drop(self) -> None:
        """The stream stayed blocked (a dead peer's collective): nothing is read, and the buffers
        are not reused (kernels queued behind the collective may still write them)."""
        self.later = []
        self.items, self.chunks, self.buf, self.base, self.cap, self.used = [], [], None, 0, 0, 0


def launch(tensors, seed: int, k: int, block_r=None, num_warps=None, progs_per_sm=None,
           maxnreg=None, split=None, depth=None):
    """Launch the kernels for a batch, each through JITFunction.run; returns (host-side finisher,
    device buffer).  Nothing here synchronises; ``finish()`` does the one D2H copy.  block_r /
    num_warps / progs_per_sm / maxnreg / split / depth tune the 16-bit kernel's schedule, never its
    result (``tuning``: else the TPPROBE_FP_* knobs)."""
    tune = tuning(block_r, num_warps, progs_per_sm, maxnreg, split, depth)
    dev = tensors[0].device
    plans, ioff, foff, ntok = plan(tensors, k, multiprocessors(dev), **tune)
    bufs = buffers(ioff, foff, ntok, dev)
    buf, flagbuf = bufs[0], bufs[3]
    if ntok:
        flagbuf.zero_()
    for kern, grid, args, kw in calls(plans, bufs, seed, k, tune, signs=lambda kp: sign_table(seed, k, kp, dev)):
        kern[grid](*args, **kw)
    # token-row flags for 2-D tensors whose width is not a multiple of 128: torch
    extra = {i: (p["t"] != 0).any(dim=1) for i, p in enumerate(plans)
             if p["t"].dim() == 2 and not p["flags"]}

    def finish(host_parts=None):
        # one D2H copy, then numpy on the host buffer: the combine is exact integers / float64.
        # host_parts: finish.parts already copied by the caller
        if host_parts is None:
            host_parts = [v.cpu().numpy() for v in finish.parts]
        ex = {i: v.astype(bool) for i, v in zip(extra, host_parts[1:])}
        hi, hf, hflag = split_buffer(host_parts[0], ioff, foff)
        return [combine_one(p, hi, hf, hflag, seed, k, rows_extra=ex.get(i), tensor=p["t"])
                for i, p in enumerate(plans)]

    finish.parts = [buf, *(v.to(torch.int64) for v in extra.values())]
    return finish, buf


def fingerprint_batch(tensors, seed: int, k: int, **kw):
    finish, _ = launch(tensors, seed, k, **kw)
    return finish()
