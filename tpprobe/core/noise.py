"""THE noise model: when do two tensors that should be equal differ by rounding only? (one rule:
full mode, fingerprint mode, `tpprobe report`, `tpprobe diff`)

One rule, used by full mode (compare / within_noise), fingerprint mode (fp_level), the offline
report and `tpprobe diff`. Two tensors x (a rank) and ref (the reference) are

  bitwise   identical bytes;
  noise     not identical, but every one of these holds:
              rel_norm   ||x - ref|| / ||ref||  (whole tensor)         <= REL[dtype]
              row_rel    the same, for the worst token row              <= ROW_REL[dtype]
              ulp_max    the worst element's difference in ULP of its own magnitude
                         (ULP of the tensor's RMS for elements below it) <= ULP[dtype]
              and NaN / Inf in the same places;
  material  otherwise.

Why these three: reduction-order noise (a different summation order, a custom all-reduce, a
fused all-reduce + RMSNorm) moves elements by 1-2 ULP, spread evenly, so its norm-wise error is a
fraction of one ULP's relative size. A material fault is either large somewhere (a wrong element,
a partial sum: caught by ulp_max), or small but systematic (a stale shard, a drift of 1 % on one
rank: caught by rel_norm, which averages rounding away and keeps a systematic error whole), or
confined to a few tokens (caught by row_rel). In bf16 a 1 % error is ~1.3 ULP of the element, so
no elementwise rule can tell it from noise; the norm-wise one can.

The bounds are calibrated on measured healthy spread (bench/noise_spread.py; docs/noise.md has
the numbers): the worst healthy rel_norm seen, times a margin, stays below the smallest error the
issue requires be found (1 % in bf16 / fp16, 0.1 % in fp32).

Fingerprint mode only knows rel_norm unless the tensor was kept: exactly from below (the sums of
squares: a drift that scales the stream), else as the k=32 sketch's estimate, which spreads
~13 % around the true value. `SKETCH_SLACK` sets the bound for that estimate at 0.9 of REL, the
point between the worst healthy spread and the 1 % to find where both tails of the estimate are
equally rare (docs/noise.md, 3000 trials: 1 % in a random direction missed 0.07 % of the time, the
worst healthy spread, 0.44 %, flagged 0.1 %); the exact lower bound is judged on REL itself.

rel diff is 1 - 2Σxy/(Σx²+Σy²) = ‖x−y‖²/(‖x‖²+‖y‖²), in float64: quadratic (a 1 %
difference is 5e-5); messages show its linear reading rel_l2 (0.01 = 1 %).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

HEAT_BINS = 256

# The levels a comparison gives, declared once, best first: every ordering of levels (the worst of a row,
# a sort) reads these, and report/labels.py LEVELS gives each its words and styles. reference and share are
# never compared (the rank the others are held to; a rank's own shard before its reduce).
COMPARED = ("bitwise", "noise", "material", "shape")
LEVEL_ORDER = ("reference", "share") + COMPARED
# how bad a compared level is (higher is worse); a value that is missing ranks with a shape mismatch:
# neither can be compared
LEVEL_RANK = {**{lv: i for i, lv in enumerate(COMPARED)}, "missing": COMPARED.index("shape")}

CROSS_RANK, RESHARDED = "cross-rank", "resharded"

# (whole-tensor rel_norm, worst-row rel_norm, worst element in ULP), per context and dtype.
# cross-rank: the same computation on every rank (after the reduces), or a rank vs the reference
#             rank; measured healthy spread 0 (bitwise) and, with every element of one rank moved
#             1-2 ULP (--inject rank-noise), 4.4e-3 / 5.5e-3 / 2 ULP in bf16 (docs/noise.md).
# resharded:  the same model at another TP degree or in another run (tp=1 reference vs tp=N,
#             `tpprobe diff`): matmuls split differently round differently, and it compounds over
#             layers: measured 1.3e-2 / 1.9e-2 / 7.5 ULP in bf16 over 6 layers.
BOUNDS = {
    CROSS_RANK: {torch.bfloat16: (7e-3, 1.5e-2, 8.0), torch.float16: (2e-3, 4e-3, 16.0),
                 torch.float32: (1e-4, 3e-4, 64.0), torch.float64: (1e-10, 3e-10, 64.0)},
    RESHARDED: {torch.bfloat16: (4e-2, 6e-2, 32.0), torch.float16: (5e-3, 1e-2, 32.0),
                torch.float32: (1e-5, 3e-5, 256.0), torch.float64: (1e-12, 3e-12, 256.0)},
}
# a reduce's output against the exact (float64) sum of its inputs, S = sqrt(sum_r ||in_r||^2):
# ||out - sum|| / S <= REDUCE_FACTOR * max(eps, 2^-17) * sqrt(ranks) (rounding once per add);
# a missing share of 1 in m equal shares is ~1/sqrt(m) of S, orders of magnitude above
REDUCE_FACTOR = 4.0
# the bound on the sketch's estimate of rel_norm, as a fraction of REL: measured spread of the k=32
# estimate / true value, 2000 trials of [64, 512] bf16: 0.1 % quantile 0.62, 99.9 % quantile 1.54
# (bench/detection_curve.py --spread); 0.9 x 7e-3 = 6.3e-3 splits 1e-2 and 4.4e-3 at equal odds
SKETCH_SLACK = 0.9


def _key(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in BOUNDS[CROSS_RANK] else torch.float32


def rel_bound(dtype: torch.dtype, context: str = CROSS_RANK) -> float:
    return BOUNDS[context][_key(dtype)][0]


def row_bound(dtype: torch.dtype, context: str = CROSS_RANK) -> float:
    return BOUNDS[context][_key(dtype)][1]


def ulp_bound(dtype: torch.dtype, context: str = CROSS_RANK) -> float:
    return BOUNDS[context][_key(dtype)][2]


def reduce_bound(dtype: torch.dtype, ranks: int) -> float:
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return REDUCE_FACTOR * max(eps, 2.0 ** -17) * math.sqrt(max(ranks, 1))


def ulp_of(mag: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at magnitude mag (float64 in, float64 out)."""
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(mag.clamp_min(fi.tiny)))
    return torch.exp2(e) * fi.eps


def measure(x: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None,
            context: str = CROSS_RANK) -> dict:
    """The numbers the rule judges (float64). dtype: the precision to judge in (default: ref's)."""
    dtype = dtype or ref.dtype
    a = x.detach().reshape(x.shape[0] if x.dim() else 1, -1).double()
    b = ref.detach().reshape(a.shape).double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    same_nf = (a.isnan() & b.isnan()) | (~fa & ~fb & (a == b))
    nf_mismatch = int((~both & ~same_nf).sum())
    a0, b0 = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    d = (a0 - b0).abs()
    nb = float(torch.linalg.vector_norm(b0))
    rel_norm = float(torch.linalg.vector_norm(d)) / nb if nb > 0 else (0.0 if d.numel() == 0 or float(d.max()) == 0
                                                                       else math.inf)
    rn_b = torch.linalg.vector_norm(b0, dim=-1)
    rn_d = torch.linalg.vector_norm(d, dim=-1)
    scale = float(rn_b.max()) if rn_b.numel() else 0.0
    # a row that is ~zero in the reference is judged on the largest row's scale
    row_rel_t = rn_d / torch.maximum(rn_b, torch.full_like(rn_b, max(scale * 1e-3, 1e-300)))
    row_rel = float(row_rel_t.max()) if row_rel_t.numel() else 0.0
    rms = math.sqrt(float((b0 * b0).sum()) / max(int(both.sum()), 1))
    fdt = dtype if dtype.is_floating_point else torch.float32
    spacing = torch.maximum(ulp_of(torch.maximum(a0.abs(), b0.abs()), fdt),
                            ulp_of(torch.tensor(max(rms, 0.0), dtype=torch.float64), fdt))
    ulp = d / spacing
    bad_el = (ulp > ulp_bound(dtype, context)) | (~both & ~same_nf)
    bad_row = bad_el.any(-1) | (row_rel_t > row_bound(dtype, context))
    return {"rel_norm": rel_norm, "row_rel_max": row_rel, "ulp_max": float(ulp.max()) if ulp.numel() else 0.0,
            "ulp_mean": float(ulp.mean()) if ulp.numel() else 0.0, "nan_mismatch": nf_mismatch,
            "max_abs": float(d.max()) if d.numel() else 0.0, "mean_abs": float(d.mean()) if d.numel() else 0.0,
            "bad_rows": bad_row, "row_rel": row_rel_t,
            "bad_fraction": float(bad_el.float().mean()) if bad_el.numel() else 0.0,
            "rms": rms}


def is_noise(m: dict, dtype: torch.dtype, context: str = CROSS_RANK) -> bool:
    """The rule, on measured numbers (a full `measure()`, or what a fingerprint gives: rel_norm)."""
    if m.get("nan_mismatch"):
        return False
    bound = rel_bound(dtype, context)
    if m.get("from") == "fingerprint":    # an exact lower bound, and the sketch's estimate
        if m.get("norm_rel", 0.0) > bound or m.get("sketch_rel", m.get("rel_norm", 0.0)) > bound * SKETCH_SLACK:
            return False
    elif m.get("rel_norm", 0.0) > bound:
        return False
    if m.get("row_rel_max") is not None and m["row_rel_max"] > row_bound(dtype, context):
        return False
    if m.get("ulp_max") is not None and m["ulp_max"] > ulp_bound(dtype, context):
        return False
    return True


def level(m: dict, dtype: torch.dtype, context: str = CROSS_RANK) -> str:
    return "noise" if is_noise(m, dtype, context) else "material"


def reduce_is_noise(err_norm: float, S: float, dtype: torch.dtype, ranks: int) -> tuple[bool, float]:
    """A reduce's output vs the exact sum of its inputs: (within rounding?, ||out - sum|| / S)."""
    if S == 0.0:
        return err_norm == 0.0, 0.0 if err_norm == 0.0 else math.inf
    rel = err_norm / S
    return rel <= reduce_bound(dtype, ranks), rel


def describe(dtype: torch.dtype, context: str = CROSS_RANK) -> str:
    return (f"noise ({context}) = rel ≤ {rel_bound(dtype, context):.1e}, worst token row ≤ "
            f"{row_bound(dtype, context):.1e}, worst element ≤ {ulp_bound(dtype, context):g} ULP "
            f"({str(dtype).replace('torch.', '')})")


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def dtype_from_str(s: str) -> torch.dtype:
    name = str(s).replace("torch.", "")
    d = getattr(torch, _ALIASES.get(name, name), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {s!r}")
    return d


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if eps_of(a) >= eps_of(b) else b


def judge_dtype(a: torch.dtype, b: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The precision two tensors are judged in: the coarser of theirs and the run's."""
    return coarser(coarser(a, b), dtype) if a.is_floating_point else dtype


def bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.is_floating_point:
        it = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return torch.equal(x.contiguous().view(it), y.contiguous().view(it))
    return torch.equal(x, y)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 1 and t.shape[0] > 0 else t.reshape(1, -1)


def heat(per_token: torch.Tensor, bins: int = HEAT_BINS) -> list[float]:
    """Per-token values reduced to at most `bins` bins by max (for heatmaps)."""
    n = per_token.numel()
    if n <= bins:
        return [float(v) for v in per_token]
    edges = torch.linspace(0, n, bins + 1).long()
    return [float(per_token[edges[i]:max(edges[i + 1], edges[i] + 1)].max()) for i in range(bins)]


def nonfinite(t: torch.Tensor) -> dict:
    if not t.dtype.is_floating_point:
        return {"nan": 0, "inf": 0, "first_token": None}
    nan, inf = t.isnan(), t.isinf()
    bad = _rows(nan | inf).any(-1)
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
    return {"nan": int(nan.sum()), "inf": int(inf.sum()), "first_token": first}


def nonzero_rows(t: torch.Tensor) -> torch.Tensor:
    return _rows(t).ne(0).any(-1)


def compare(x: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None,
            context: str = CROSS_RANK) -> dict:
    """Stats of x against ref and the level the noise model gives them. dtype: the precision the
    rule is judged in (default: the coarser of the two)."""
    if tuple(x.shape) != tuple(ref.shape):
        return {"level": "shape", "shape": list(x.shape), "ref_shape": list(ref.shape)}
    if bitwise_equal(x, ref):
        return {"level": "bitwise", "max_abs": 0.0, "mean_abs": 0.0, "rel_diff": 0.0, "rel_norm": 0.0,
                "row_rel_max": 0.0, "ulp_max": 0.0, "ulp_mean": 0.0, "first_token": None, "bad_fraction": 0.0,
                "heat": [0.0] * min(max(x.shape[0] if x.dim() else 1, 1), HEAT_BINS), "nan_mismatch": 0}
    dtype = dtype or coarser(x.dtype, ref.dtype)
    m = measure(x, ref, dtype, context)
    lv = level(m, dtype, context)
    rows = m.pop("bad_rows")
    if lv == "material" and not bool(rows.any()):
        rows = m.pop("row_rel") > rel_bound(dtype, context)     # material as a whole: the rows that carry it
    else:
        m.pop("row_rel")
    first = int(rows.nonzero()[0, 0]) if bool(rows.any()) else (0 if lv == "material" else None)
    a, b = _rows(x.double()), _rows(ref.double())
    both = torch.isfinite(a) & torch.isfinite(b)
    a0, b0 = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    sxy, sxx, syy = float((a0 * b0).sum()), float((a0 * a0).sum()), float((b0 * b0).sum())
    m.update(level=lv, rel_diff=0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy)),
             first_token=first, heat=heat((a0 - b0).abs().amax(-1) if a0.numel() else torch.zeros(1)))
    m.pop("rms", None)
    return m


def within_noise(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[dict]:
    """{"level": "bitwise"|"noise", max_abs, rel_diff, rel_norm} when x equals ref within the noise
    model; None when not (then call compare() for the details)."""
    if tuple(x.shape) != tuple(ref.shape):
        return None
    c = compare(x, ref, dtype)
    return c if c["level"] in ("bitwise", "noise") else None


def _bitwise_sum(out: torch.Tensor, ins: list, expected: torch.Tensor) -> bool:
    """Whether every element of `out` is bit for bit a sum of `ins` in its own dtype: the correctly
    rounded one (the float64 `expected` rounded once) or one a backend computes, adding the ranks in
    a cyclic order (gloo's and NCCL's rings start each chunk at another rank; either direction). That
    is exactly what a complete reduce returns, never rounding noise."""
    if not out.is_floating_point() or len(ins) < 2 or any(tuple(t.shape) != tuple(out.shape) for t in ins):
        return False
    hit = out == expected.to(out.dtype)
    n = len(ins)
    for order in [[(s + k) % n for k in range(n)] for s in range(n)] + \
                 [[(s - k) % n for k in range(n)] for s in range(n)]:
        if bool(hit.all()):
            return True
        acc = ins[order[0]].to(out.dtype)
        for q in order[1:]:
            acc = acc + ins[q].to(out.dtype)
        hit |= out == acc
    return bool(hit.all())


def reduce_check(out: torch.Tensor, ins: list, expected: torch.Tensor, dtype: torch.dtype) -> dict:
    """A collective's output against what a complete one returns (float64 `expected`, from every
    rank's input): exact, noise (rounding once per add) or material (a share missing or wrong)."""
    if tuple(out.shape) != tuple(expected.shape):
        return {"level": "material", "rel_norm": math.inf, "max_abs": math.inf}
    o = out.double()
    if bool(torch.equal(o, expected)) or _bitwise_sum(out, ins, expected):
        return {"level": "exact", "rel_norm": 0.0, "max_abs": 0.0}
    fin_o, fin_e = torch.isfinite(o), torch.isfinite(expected)
    if not bool(fin_o.all()) or not bool(fin_e.all()):
        # NaN / Inf where a complete reduce has them (NaN spreads through a sum): the finite
        # elements are judged by the rule below, the non-finite ones must sit in the same places
        if not (bool(torch.equal(fin_o, fin_e)) and bool(torch.equal(o.isnan(), expected.isnan()))
                and bool(torch.equal(o[~fin_o & ~o.isnan()], expected[~fin_e & ~expected.isnan()]))):
            return {"level": "material", "rel_norm": math.inf, "max_abs": math.inf}
        o, expected = torch.where(fin_o, o, 0.0), torch.where(fin_e, expected, 0.0)
        ins = [torch.where(torch.isfinite(t.double()), t.double(), 0.0) for t in ins]
        if bool(torch.equal(o, expected)):
            return {"level": "exact", "rel_norm": 0.0, "max_abs": 0.0}
    d = o - expected
    S = math.sqrt(sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in ins))
    ok, rel = reduce_is_noise(float(torch.linalg.vector_norm(d)), S, dtype, len(ins))
    return {"level": "noise" if ok else "material", "rel_norm": rel, "max_abs": float(d.abs().max())}


def rel_l2(rel_diff: float) -> float:
    """The linear reading of rel_diff: ‖a−b‖ / sqrt((‖a‖²+‖b‖²)/2), the norm-wise relative difference
    (0.01 = 1 %). rel_diff itself is quadratic (1e-4 for a 1 % difference), which reads as if it
    contradicted a large max abs diff; messages show this one."""
    import math
    return math.sqrt(max(0.0, 2.0 * float(rel_diff)))


# ---- the same verdict, fast: for large tensors of one dtype (the dumper's report and diff) -------------
# integer view, magnitude mask, the magnitude bits of +Inf (at or above: Inf / NaN)
INT_VIEW = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
            torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}
PROOF_CHUNK = 1 << 20          # elements per chunk (whole token rows); the buffers below are this size
_U32 = 2.0 ** -24              # float32 unit roundoff
# reused chunk buffers (a fresh one costs a page fault per 4 KiB); one caller at a time. Process-wide by nature:
# scratch memory, no result survives in it from one call to the next
_WS: dict = {}


def _buf(slot: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    t = _WS.get(slot)
    if t is None or t.numel() < n or t.dtype != dtype:
        t = _WS[slot] = torch.empty(max(n, 1), dtype=dtype)
    return t[:n]


def has_nonfinite(t: torch.Tensor) -> bool:
    """Any NaN or Inf in t (from the bits, in chunks: no float copy)."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return False
    if t.dtype not in INT_VIEW:
        return not bool(torch.isfinite(t).all())
    it, mag, inf = INT_VIEW[t.dtype]
    flat = t.contiguous().reshape(-1).view(it)
    for i in range(0, flat.numel(), PROOF_CHUNK):
        c = flat[i:i + PROOF_CHUNK]
        s = _buf("s", c.numel(), it)
        torch.bitwise_and(c, mag, out=s)
        if int(s.max()) >= inf:
            return True
    return False


def fast_level(x: torch.Tensor, ref: torch.Tensor, context: str = CROSS_RANK) -> Optional[dict]:
    """compare()'s verdict on x against ref when it can be shown cheaply, else None (then compare()
    decides). Only for one shape and one float dtype with an integer view (bf16, fp16, fp32), judged
    in that dtype. It says "bitwise" for identical bytes, and "noise" only where compare() says noise:

      elements  both finite, one sign, and |bits(x) - bits(ref)| = k <= ulp_bound: k representable
                steps, each at most one ULP of the larger magnitude; compare()'s spacing is that ULP or
                the RMS's (never smaller), so its ULP count is <= k. NaN/Inf, a sign change (±0
                included) or a larger k: None.
      rel_norm, row_rel  from float32 row norms of x - ref (exact in float32: two values of one sign
                within k steps), accepted only below bound × (1 - margin), the margin covering float32
                rounding of a sum of squares over a row (tests/unit/test_noise_fast.py checks the edges).

    Work per element: a memcmp; then, only if the bytes differ, integer passes over the views and
    two float32 conversions into reused buffers."""
    if tuple(x.shape) != tuple(ref.shape) or x.dtype != ref.dtype or x.dtype not in INT_VIEW:
        return None
    it, mag, inf = INT_VIEW[x.dtype]
    xa, ra = _rows(x.contiguous()).view(it), _rows(ref.contiguous()).view(it)
    if torch.equal(xa, ra):
        return {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0, "rel_norm": 0.0, "row_rel_max": 0.0,
                "ulp_max": 0.0, "first_token": None, "nan_mismatch": 0}
    kb = int(ulp_bound(x.dtype, context))
    rows, cols = xa.shape
    margin = 1.0 - 4.0 * (cols + 4) * _U32
    if margin < 0.5 or xa.numel() == 0:
        return None
    step = max(1, PROOF_CHUNK // max(cols, 1))
    nb, na, nd = [], [], []
    k_max, n_diff, max_abs = 0, 0, 0.0
    for i in range(0, rows, step):
        a, b = xa[i:i + step], ra[i:i + step]
        n, shp = a.numel(), a.shape
        s, d = _buf("s", n, it).view(shp), _buf("d", n, it).view(shp)
        torch.bitwise_and(b, mag, out=s)
        if int(s.max()) >= inf - kb:
            return None                 # NaN/Inf in ref, or x within reach of them
        torch.bitwise_xor(a, b, out=s)
        if int(s.min()) < 0:
            return None                 # a sign bit differs somewhere
        torch.sub(a, b, out=d)          # one sign: no overflow, the count of steps between magnitudes
        lo, hi = (int(v) for v in torch.aminmax(d))
        if lo < -kb or hi > kb:
            return None
        fb = _buf("fb", n, torch.float32).view(shp)
        fb.copy_(b.view(x.dtype))
        nb.append(torch.linalg.vector_norm(fb, dim=-1))
        if lo == 0 and hi == 0:
            na.append(nb[-1])
            nd.append(torch.zeros_like(nb[-1]))
            continue
        fa = _buf("fa", n, torch.float32).view(shp)
        fa.copy_(a.view(x.dtype))
        na.append(torch.linalg.vector_norm(fa, dim=-1))
        fa.sub_(fb)
        nd.append(torch.linalg.vector_norm(fa, dim=-1))
        lo_f, hi_f = torch.aminmax(fa)
        max_abs = max(max_abs, -float(lo_f), float(hi_f))
        k_max = max(k_max, -lo, hi)
        n_diff += int(torch.count_nonzero(d))
    rb, ra_, rd = (torch.cat(v).double() for v in (nb, na, nd))
    syy, sxx, sdd = float((rb * rb).sum()), float((ra_ * ra_).sum()), float((rd * rd).sum())
    if syy <= 0.0:
        return None
    rel_norm = math.sqrt(sdd / syy)
    scale = float(rb.max())
    row_rel = float((rd / rb.clamp_min(max(scale * 1e-3, 1e-300))).max())
    if rel_norm > rel_bound(x.dtype, context) * margin or row_rel > row_bound(x.dtype, context) * margin:
        return None
    return {"level": "noise", "max_abs": max_abs, "rel_diff": max(0.0, sdd / (sxx + syy)), "rel_norm": rel_norm,
            "row_rel_max": row_rel, "ulp_max": float(k_max), "differing": n_diff, "first_token": None,
            "nan_mismatch": 0, "by": f"proof: ≤ {k_max} ULP, rel {rel_norm:.1e}, worst row {row_rel:.1e}"}
