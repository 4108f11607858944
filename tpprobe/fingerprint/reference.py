"""Fingerprints of captured tensors: checks that cost a few KB, not a gather.

A :class:`Fingerprint` holds

* ``bit_hash``: an exact 128-bit hash of the tensor's bytes (32 hex chars).
  The bytes are read as little-endian uint32 words (zero-padded to a multiple
  of 4 bytes).  CPU tensors: blake2b-128 of the bytes.  CUDA tensors: word ``q`` is
  words are taken in pairs, each pair mixed with its index through ONE bijective 32-bit mixer,
  ``h_p = lowbias32(((w_2p ^ (p*QA+SA)) + w_2p+1 * QB) mod 2^32)``; lane a = sum h_p mod 2^32,
  lane b = xor of the h_p (then passed through the splitmix64 finalizer, a bijection, for
  display).  Changing any single word always changes both lanes; a change confined to one pair
  of words collides with probability about 2^-32, any other change about 2^-64 (see
  ``_hash_words``).  -0.0 and 0.0 differ (their bytes differ).
  CPU and CUDA hashes are never compared with each other.  The hash does not depend on ``seed``.
* ``sketch``: a seeded LINEAR sketch, ``sketch[j] = sum_i s_j(i) * x_i`` with
  ``s_j(i) = a_j(i mod 128) * b_(j mod 4)(i // 128)`` in {+1, -1}: a column sign per entry and
  one of 4 row-sign copies.  ``a_j`` / ``b_c`` are bits of counter-based hashes of (seed, j,
  column) and (seed, row), so no k x n matrix is stored and every rank derives the same signs.
  Each entry of the sketch of a difference d has mean 0 and variance sum_r (a_j . d_r)^2, as
  with independent row signs per entry; 4 copies (not k) let the CUDA kernel keep the row-signed
  column sums in registers with 8 FMAs per 32-bit word.  Linearity makes all-reduce completeness
  checkable on sketches: ``sketch(out) ~= sum_r sketch(in_r)``.
* ``sumsq`` (sum of squares, float64), ``absmax`` (max |x| ignoring NaN),
  ``n_nan``, ``n_inf``, and ``row_nonzero``: for a 2-D [tokens, hidden]
  tensor a hex bitmap (bit r, little-endian bit order within each byte) of the
  token rows that hold any non-zero element; empty for other ranks.

The PyTorch path here is the reference (float64 sketch on CPU, float32 blocks
on GPU).  CUDA tensors go through the fused Triton kernel in
``tpprobe.fingerprint.triton`` when triton imports; it yields the identical
``bit_hash`` / counts / bitmap and a sketch equal within float tolerance.
"""
from __future__ import annotations

import hashlib
import math
import sys

import torch

from ..core.tensors import tensor_bytes
from ..config.knobs import knob_set

from .definition import (M32, QA, QB, SA, SKETCH_ROW, Fingerprint, Pending, column_signs, hash_hex, mix_a,
                         row_signs)

__all__ = ["Fingerprint", "fingerprint", "fingerprints", "sum_matches", "sketch_close",
           "SKETCH_ROW"]

PROBE_SEED, PROBE_K = 0x7470, 32   # `tpprobe probe --exchange fingerprint`: every rank sketches with the same signs
_CHUNK_ROWS = 8192        # CPU path: rows of 128 elements per chunk (1 Mi elements)


def _bitmap_hex(flags: torch.Tensor) -> str:
    """bool [rows] -> hex string, bit r of byte r//8 (little-endian bit order)."""
    f = flags.to("cpu", torch.uint8).flatten()
    n = f.numel()
    pad = (-n) % 8
    if pad:
        f = torch.cat([f, torch.zeros(pad, dtype=torch.uint8)])
    w = f.view(-1, 8).to(torch.int64) << torch.arange(8)
    return bytes(w.sum(1).to(torch.uint8).tolist()).hex()


# --------------------------------------------------------------------------- torch path
def _words(byts: torch.Tensor) -> torch.Tensor:
    """uint8 [nb] -> int64 tensor of little-endian uint32 words (zero-padded)."""
    pad = (-byts.numel()) % 4
    if pad:
        byts = torch.cat([byts, torch.zeros(pad, dtype=torch.uint8, device=byts.device)])
    return byts.view(torch.int32).to(torch.int64) & M32


def _hash_words(w: torch.Tensor, q0: int) -> tuple[int, int]:
    """CUDA word hash (the Triton kernels compute the same): the words are taken in pairs
    (a zero word pads an odd count), ONE mixer per pair,
    h_p = lowbias32(((w_2p ^ (p*QA + SA)) + w_2p+1 * QB) mod 2^32); lane a = sum h_p mod 2^32,
    lane b = xor of the h_p.  For a fixed pair index, changing either word alone changes the
    mixer's input (xor with a constant and multiplication by the odd QB are bijections) and so
    h_p (lowbias32 is a bijection): any single-word change always changes both lanes.  A change
    of both words of one pair collides only if the inputs coincide (about 2^-32); changes in
    several pairs collide in lane a only if the mixed differences cancel mod 2^32 and in lane b
    only if they cancel under xor, about 2^-32 each and unrelated (the mixer is nonlinear over
    both + and xor), so about 2^-64.  q0 (the chunk's first word index) is even."""
    if w.numel() % 2:
        w = torch.cat([w, w.new_zeros(1)])
    w2 = w.view(-1, 2)
    p = (torch.arange(w2.shape[0], dtype=torch.int64, device=w.device) + q0 // 2) & M32
    u = ((w2[:, 0] ^ ((p * QA + SA) & M32)) + w2[:, 1] * QB) & M32
    h = mix_a(u)
    # each summand < 2^32 and a chunk has < 2^31 pairs: the int64 sum is exact
    return int(h.sum()) & M32, _xor_reduce(h)


def _xor_reduce(x: torch.Tensor) -> int:
    """xor of all elements of an int64 tensor (pairwise folds: torch has no xor reduction)."""
    x = x.reshape(-1)
    acc = 0
    while x.numel() > 1:
        if x.numel() % 2:
            acc ^= int(x[-1])
            x = x[:-1]
        n = x.numel() // 2
        x = x[:n] ^ x[n:]
    return acc ^ (int(x[0]) if x.numel() else 0)


# process-wide by nature: a pure function of its key (seed, k, device, dtype) and row, the same for every run
_ROW_SIGNS: dict = {}


def _cached_row_signs(r0: int, nrows: int, seed: int, k: int, device, acc) -> torch.Tensor:
    """Row signs for rows [r0, r0+nrows), from a per-(seed, k, device) cache that grows as needed
    (the hook fingerprints every layer's stream: the signs are the same each time)."""
    key = (seed, k, str(device), acc)
    have = _ROW_SIGNS.get(key)
    if have is None or have.shape[0] < r0 + nrows:
        n = max(r0 + nrows, 2 * (have.shape[0] if have is not None else 0))
        rows = torch.arange(0, n, dtype=torch.int64, device=device)
        have = _ROW_SIGNS[key] = row_signs(rows, seed, k).to(acc)
    return have[r0:r0 + nrows]


def _fingerprint_torch(t: torch.Tensor, seed: int, k: int) -> Fingerprint:
    flat = t.detach().contiguous().reshape(-1)
    n = flat.numel()
    isz = flat.element_size()
    on_cpu = flat.device.type == "cpu"
    acc = torch.float64 if on_cpu else torch.float32
    byts = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    A = column_signs(seed, k, flat.device, acc)
    chunk = _CHUNK_ROWS * SKETCH_ROW if on_cpu else 1 << 26
    la = lb = 0
    sk = torch.zeros(k, dtype=torch.float64)
    sumsq = 0.0
    absmax = 0.0
    n_nan = n_inf = 0
    # On CPU the exact hash is blake2b-128 of the bytes (hashlib: ~1 GB/s, where the word mixer
    # in int64 torch ops runs at a few MB/s). Hashes are only ever compared between ranks of one
    # run, which share a device type; CUDA tensors keep the word mixer the Triton kernel matches.
    blake = hashlib.blake2b(digest_size=16) if on_cpu else None
    for e0 in range(0, n, chunk):
        e1 = min(n, e0 + chunk)
        if blake is not None:
            blake.update(tensor_bytes(byts[e0 * isz:e1 * isz]))
        else:
            a, b = _hash_words(_words(byts[e0 * isz:e1 * isz]), e0 * isz // 4)
            la = (la + a) & M32
            lb ^= b
        x = flat[e0:e1]
        if x.is_complex():
            x = torch.view_as_real(x).reshape(-1)  # pragma: no cover - not a capture dtype
        x = x.to(acc) if x.dtype != torch.float32 or not on_cpu else x
        m = x.numel()
        pad = (-m) % SKETCH_ROW
        xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
        X = xp.view(-1, SKETCH_ROW)
        r0 = e0 // SKETCH_ROW
        # 128-term partial sums in the capture's precision (<= fp32), the rest in float64 on CPU
        Y = X @ A.to(X.dtype)                               # [rows, k]
        sk += (Y.to(acc) * _cached_row_signs(r0, X.shape[0], seed, k, X.device, acc)).sum(0).to("cpu", torch.float64)
        sumsq += float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2) if m else 0.0
        if m and not bool(torch.isfinite(x).all()):         # one pass when everything is finite
            isn = torch.isnan(x)
            n_nan += int(isn.sum())
            n_inf += int(torch.isinf(x).sum())
            absmax = max(absmax, float(torch.where(isn, torch.zeros_like(x), x.abs()).max()))
            sumsq = float("nan") if n_nan else sumsq
        elif m:
            absmax = max(absmax, float(x.abs().max()))
    rows_hex = ""
    if t.dim() == 2:
        rows_hex = _bitmap_hex((t.detach() != 0).any(dim=1) if t.shape[1] else
                               torch.zeros(t.shape[0], dtype=torch.bool))
    return Fingerprint(shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                       bit_hash=blake.hexdigest() if blake is not None else hash_hex(la, lb), sketch=sk.tolist(),
                       sumsq=sumsq, absmax=absmax, n_nan=n_nan, n_inf=n_inf,
                       row_nonzero=rows_hex, seed=seed)


# --------------------------------------------------------------------------- dispatch
# CUDA tensors that took the torch path, by reason (the probe reports these: a GPU where the
# fused kernel cannot build, e.g. 16-bit tensors before sm_90, says so instead of being slow quietly).
# Process-wide by nature: what this process's GPU and Triton cannot do, said once on stderr and in every record
TORCH_PATH: dict = {}


def _torch_path(reason: str) -> None:
    if reason not in TORCH_PATH and "sm_" in reason:
        import sys
        print(f"tpprobe: fingerprints take the torch path: {reason}", file=sys.stderr)
    TORCH_PATH[reason] = TORCH_PATH.get(reason, 0) + 1


def host_combine_notes() -> list:
    """Why this process combined its fused fingerprints on the host instead of the device, if it
    did: TPPROBE_FP_HOST_COMBINE, or the device combine failing once (then every later batch).
    Reads the kernel module only if a fingerprint already imported it (a CPU run never does)."""
    import sys
    state = sys.modules.get(f"{__package__}.triton.state")
    if state is None:
        return []
    return (["TPPROBE_FP_HOST_COMBINE is set"] if knob_set("TPPROBE_FP_HOST_COMBINE") else []) + \
        list(state.STATE.combine_why)


def fingerprint(t: torch.Tensor, seed: int = 0, k: int = 32) -> Fingerprint:
    """Fingerprint one tensor (on its own device). k in 1..64."""
    return fingerprints([t], seed=seed, k=k)[0]


def fingerprints(tensors: list, seed: int = 0, k: int = 32) -> list[Fingerprint]:
    """Fingerprint several tensors; CUDA tensors share one device->host transfer."""
    if not 1 <= k <= 64:
        raise ValueError("k must be in 1..64")
    d = Deferred(seed, k)
    out = [d(t) for t in tensors]
    d.resolve()
    return [resolved(x) for x in out]


class Deferred:
    """Fingerprints for a whole forward with no host sync inside it: each CUDA tensor's kernel is
    queued on the current stream when it is captured (stream order keeps the in-place all-reduce
    from overwriting an input before it is read), and ``resolve()`` reads every launch's partials
    with ONE device-to-host copy after the forward.  Tensors the fused kernel does not take (CPU,
    odd layouts, pre-Hopper 16-bit) are fingerprinted at once.  The launches go through one
    ``triton.Batch``, made at the first CUDA tensor (a CPU run never imports triton):
    the environment (TPPROBE_FINGERPRINT_TORCH, the TPPROBE_FP_* knobs) is read then, once."""

    def __init__(self, seed: int, k: int):
        self.seed, self.k = seed, k
        self.batch = None          # False: no CUDA tensor takes the fused kernel (self.why)
        self.why = ""

    def __call__(self, t: torch.Tensor, later: bool = False):
        if t.is_cuda:
            b = self.batch if self.batch is not None else self._start()
            if b:
                it = b.take(t, later)   # the queued launch is itself the Pending its read fills
                if it is not None:
                    return it
            self._refused(t)
        return _fingerprint_torch(t, self.seed, self.k)

    _take = __call__          # the Python path, which fast()'s Taker calls for what C does not take

    def fast(self):
        """This Deferred's call and ``later`` in C where fingerprint/triton/native.c is built (a
        batch on a GPU built it earlier in the process), else the Deferred itself. A new object each
        time: it holds the Deferred, never the other way round."""
        nat = sys.modules.get("tpprobe.fingerprint.triton.native")
        if nat is None or nat.NATIVE is None:
            return self
        from .triton.batch import Item
        return nat.taker(self, self._take, Item) or self

    def later(self, t: torch.Tensor):
        """As a call, for a tensor that is the caller's own and is never written again (a copy, a sum
        it made): its kernel is launched by ``resolve`` with the others so queued, not now."""
        return self(t, True)

    def _start(self):
        if knob_set("TPPROBE_FINGERPRINT_TORCH"):
            self.why, self.batch = "TPPROBE_FINGERPRINT_TORCH is set", False
            return False
        try:
            from . import triton as tf
        except Exception as e:
            self.why, self.batch = f"triton does not import ({type(e).__name__})", False
            return False
        self.batch = tf.Batch(self.seed, self.k)
        return self.batch

    def _refused(self, t: torch.Tensor) -> None:
        """Record why a CUDA tensor takes the torch path (the probe reports these)."""
        why = self.why
        if not why:
            from . import triton as tf
            why = tf.unsupported_reason(tuple(t.shape), t.dtype, t.element_size(), t.is_contiguous(),
                                        t.data_ptr(), tf.device_cc(t.device))
        _torch_path(why)

    def resolve(self, only=None) -> None:
        """Read every launch (``only``: the ids of the Pendings still wanted; the others are never
        read, e.g. those computed after a collective that never completed)."""
        if self.batch:
            self.batch.read(only)

    def drop(self) -> None:
        """The stream stayed blocked (a dead peer's collective): never read these."""
        if self.batch:
            self.batch.drop()


def resolved(x):
    """A summary as stored by the Tap: a Pending is replaced by its fingerprint (None if dropped)."""
    return x.fp if isinstance(x, Pending) else x


# --------------------------------------------------------------------------- judging
def _eps(dtype) -> float:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    e = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    # floor: float32 sketch accumulation noise (blocked sums on GPU)
    return max(e, 2.0 ** -17)


NOISE_FACTOR = 4.0


def sum_matches(out_fp: Fingerprint, in_fps: list, dtype: torch.dtype) -> tuple[bool, float]:
    """Is the all-reduce output the sum of the inputs?  Judged on the sketches.

    Rule: with m = len(in_fps), k sketch entries, u = max(eps(dtype), 2^-17),
    S = max(sqrt(sum_r sumsq(in_r)), sqrt(sumsq(out)))::

        rel = ||sketch(out) - sum_r sketch(in_r)||_2 / (sqrt(k) * S)
        ok  = rel <= 4 * u * sqrt(m)

    Why: the sketch is linear and its random signs make each entry of the
    sketch of a difference vector d have mean 0 and variance ||d||^2, so
    rel ~= ||d|| / S.  Reduction-order rounding gives ||d|| <~ 0.3 * u *
    sqrt(m-1) * S (one rounding per add, independent errors), an order of
    magnitude under the bound; a missing share d = -in_r gives
    rel ~= ||in_r|| / S (0.7 for 1 of 2 equal shares, 0.7 for 2 of 4, 0.35 for
    1 of 8), far above it (bf16: 0.044 for m=2, 0.088 for m=8).  A missing share
    whose norm is below ~ 4*u*sqrt(m) of the total cannot be told from noise.
    Shapes must agree and no NaN may be present; otherwise (False, nan).
    Returns (ok, rel).
    """
    fps = [out_fp, *in_fps]
    if not in_fps or any(f.shape != out_fp.shape for f in in_fps):
        return False, float("nan")
    if any(f.k != out_fp.k or f.seed != out_fp.seed for f in in_fps):
        raise ValueError("sketches differ in k or seed")
    if any(f.n_nan for f in fps) or any(f.n_inf for f in fps):
        return False, float("nan")
    k = out_fp.k
    diff = [out_fp.sketch[j] - math.fsum(f.sketch[j] for f in in_fps) for j in range(k)]
    err = math.sqrt(math.fsum(d * d for d in diff))
    S = max(math.sqrt(math.fsum(f.sumsq for f in in_fps)), math.sqrt(out_fp.sumsq))
    if S == 0.0:
        return err == 0.0, 0.0 if err == 0.0 else float("inf")
    rel = err / (math.sqrt(k) * S)
    from ..core.noise import reduce_bound     # the one noise model's reduce rule
    return rel <= reduce_bound(dtype if not isinstance(dtype, str) else getattr(torch, dtype), len(in_fps)), rel


def sketch_close(a: Fingerprint, b: Fingerprint, dtype) -> bool:
    """Are two captures equal within rounding noise?  Bitwise-equal ones are;
    otherwise shapes must agree, NaN/Inf counts match and
    ||sketch(a) - sketch(b)|| / (sqrt(k) * max(||a||, ||b||)) <= 4 * u * sqrt(2)
    (the sum_matches rule with one term each side)."""
    if a.shape != b.shape:
        return False
    if a.bit_hash == b.bit_hash and a.dtype == b.dtype:
        return True
    if a.k != b.k or a.seed != b.seed:
        raise ValueError("sketches differ in k or seed")
    if (a.n_nan, a.n_inf) != (b.n_nan, b.n_inf) or a.n_nan:
        return False
    err = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a.sketch, b.sketch)))
    S = math.sqrt(max(a.sumsq, b.sumsq))
    if S == 0.0:
        return err == 0.0
    return err / (math.sqrt(a.k) * S) <= NOISE_FACTOR * _eps(dtype) * math.sqrt(2)
