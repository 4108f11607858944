"""The fingerprint's definition, shared by the PyTorch path (reference.py) and the Triton
kernels (triton/): the hash constants and mixers, the sign patterns of the sketch,
and the `Fingerprint` record both produce. Neither path imports the other for these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
SKETCH_ROW = 128          # sign pattern row width (elements): s_j(i) = a_j(i % 128) * b_(j%4)(i // 128)
ROW_COPIES = 4            # row-sign copies: entry j uses copy j % 4

# lane constants (fixed: the bit hash is independent of the sketch seed)
QA, SA = 0x9E3779B1, 0x6A09E667
QB = 0x85EBCA77                   # odd: w -> w * QB is a bijection of 2^32


# --------------------------------------------------------------------------- mixing
def mix_a(x):
    """lowbias32 on a Python int or an int64 tensor holding uint32 values (bijection of 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def fmix64(x: int) -> int:
    """splitmix64 finalizer: a bijection of 2^64, so it spreads the lane sums
    over all 64 bits without losing information."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def hash_hex(la: int, lb: int) -> str:
    return f"{fmix64(la):016x}{fmix64(lb ^ 0x5851F42D4C957F2D):016x}"


def salt(seed: int, tag: int) -> int:
    s = seed & M64
    return mix_a(mix_a((s & M32) ^ 0x3C6EF372) ^ (s >> 32) ^ ((tag * 0xA54FF53A) & M32))


def col_salts(seed: int, groups: int) -> list[int]:
    return [salt(seed, 2 * g + 1) for g in range(groups)]


def row_salts(seed: int, groups: int) -> list[int]:
    return [salt(seed, 2 * g + 2) for g in range(groups)]


def sign_bits(idx: torch.Tensor, salts: list[int], k: int) -> torch.Tensor:
    """[len(idx), k] float tensor of +-1: bit (j % 32) of mix_a((idx mod 2^32) ^ salt[j // 32])."""
    idx = idx & M32
    j = torch.arange(k, device=idx.device)
    cols = []
    for g, s in enumerate(salts):
        h = mix_a(idx ^ s)
        jj = j[g * 32:(g + 1) * 32] - g * 32
        cols.append((h[:, None] >> jj[None, :]) & 1)
    bits = torch.cat(cols, dim=1)
    return 1.0 - 2.0 * bits.to(torch.float64)


# process-wide by nature: a pure function of its key (seed, k, device, dtype), the same for every run
_A_CACHE: dict = {}


def column_signs(seed: int, k: int, device="cpu", dtype=torch.float64) -> torch.Tensor:
    """The [128, k] +-1 matrix a_j(c) (exact in any float dtype)."""
    key = (seed, k, str(device), dtype)
    a = _A_CACHE.get(key)
    if a is None:
        a = sign_bits(torch.arange(SKETCH_ROW, dtype=torch.int64), col_salts(seed, (k + 31) // 32), k)
        a = a.to(device=device, dtype=dtype)
        _A_CACHE[key] = a
    return a


def row_signs(rows: torch.Tensor, seed: int, k: int) -> torch.Tensor:
    """[len(rows), k] +-1 matrix b_(j % 4)(r) (float64): bit (j % 4) of mix_a(r ^ salt)."""
    idx = rows.to(torch.int64) & M32
    h = mix_a(idx ^ row_salts(seed, 1)[0])
    j = torch.arange(k, device=idx.device) % ROW_COPIES
    return 1.0 - 2.0 * ((h[:, None] >> j[None, :]) & 1).to(torch.float64)


# --------------------------------------------------------------------------- dataclass
@dataclass
class Fingerprint:
    shape: list
    dtype: str
    bit_hash: str
    sketch: list = field(default_factory=list)
    sumsq: float = 0.0
    absmax: float = 0.0
    n_nan: int = 0
    n_inf: int = 0
    row_nonzero: str = ""
    seed: int = 0

    @property
    def k(self) -> int:
        return len(self.sketch)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        # the fields in order, as dataclasses.asdict gives them (without its deep copy: a probe
        # writes one per point and collective); JSON has no inf/nan: those become strings
        return {"shape": list(self.shape), "dtype": self.dtype, "bit_hash": self.bit_hash,
                "sketch": enc_floats(self.sketch), "sumsq": enc_float(self.sumsq),
                "absmax": enc_float(self.absmax), "n_nan": self.n_nan, "n_inf": self.n_inf,
                "row_nonzero": self.row_nonzero, "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict) -> "Fingerprint":
        d = dict(d)
        for key in ("sumsq", "absmax"):
            d[key] = float(d[key])
        d["sketch"] = [float(v) for v in d["sketch"]]
        d["shape"] = list(d["shape"])
        return cls(**d)

    def nonzero_rows(self) -> list[bool]:
        """Decoded row_nonzero bitmap (one bool per token row)."""
        if not self.row_nonzero:
            return []
        b = bytes.fromhex(self.row_nonzero)
        n = self.shape[0]
        return [bool((b[r >> 3] >> (r & 7)) & 1) for r in range(n)]


def enc_float(v):
    v = float(v)
    return v if math.isfinite(v) else repr(v)   # 'inf', '-inf', 'nan' -> float() reads them


def enc_floats(vs) -> list:
    """``[enc_float(v) for v in vs]``; one C-level sum says when every value is finite (a NaN or
    an Inf makes the sum non-finite), which is nearly always, then the floats are the list."""
    vs = list(map(float, vs))
    return vs if math.isfinite(sum(vs)) else [enc_float(v) for v in vs]


class Pending:
    """A fingerprint launched on the GPU and not read yet (``Deferred.resolve`` fills ``fp``)."""
    __slots__ = ("fp",)

    def __init__(self):
        self.fp = None
