"""The noise rule's fast path (`fast_level`, used by `tpprobe report`/`diff` on dumper folders) gives
compare()'s verdict or none: on crafted tensors across the bound edges (element ULP, whole-tensor
rel_norm, worst row), NaN/Inf, negative zero and sign changes, in bf16, fp16 and fp32 and both
contexts. It must decide the common cases (bitwise, 1-2 ULP noise) itself, or it is no fast path."""
from __future__ import annotations

import pytest
import torch

from tpprobe.core.noise import (CROSS_RANK, INT_VIEW, RESHARDED, compare, fast_level, has_nonfinite, rel_bound,
                                row_bound, ulp_bound)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ref(dtype, rows=48, cols=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(dtype)


def _step(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """t moved by k representable steps away from zero (k >= 0) or towards it (k < 0), per element."""
    it = INT_VIEW[t.dtype][0]
    bits = t.view(it).clone()
    neg = bits < 0
    mag = bits & INT_VIEW[t.dtype][1]
    mag = mag + k.to(it)
    return torch.where(neg, mag | torch.tensor(-(2 ** (8 * t.element_size() - 1)), dtype=it), mag).view(t.dtype)


def _agree(x, ref, context=CROSS_RANK):
    """fast_level is None or says what compare() says (level, and numbers consistent with it)."""
    c = compare(x, ref, dtype=x.dtype, context=context)
    f = fast_level(x, ref, context)
    if f is not None:
        assert f["level"] == c["level"], (f, c["level"])
        if f["level"] == "noise":
            assert f["ulp_max"] >= c["ulp_max"] - 1e-9                  # steps: an upper bound of the ULP count
            assert f["rel_norm"] == pytest.approx(c["rel_norm"], rel=1e-4)
            assert f["row_rel_max"] == pytest.approx(c["row_rel_max"], rel=1e-4)
            assert f["max_abs"] == pytest.approx(c["max_abs"], rel=1e-6)
            assert f["rel_diff"] == pytest.approx(c["rel_diff"], rel=1e-3, abs=1e-12)
    return f, c


@pytest.mark.parametrize("dtype", DTYPES)
def test_common_cases_decided_fast(dtype):
    ref = _ref(dtype)
    f, c = _agree(ref.clone(), ref)
    assert f is not None and f["level"] == c["level"] == "bitwise"
    k = torch.zeros(ref.shape, dtype=torch.int64)
    k.view(-1)[::7] = 1
    f, c = _agree(_step(ref, k), ref)
    assert f is not None and f["level"] == c["level"] == "noise" and f["ulp_max"] == 1
    k.view(-1)[3::7] = -2
    f, c = _agree(_step(ref, k), ref)
    assert f is not None and f["level"] == "noise" and f["ulp_max"] == 2


@pytest.mark.parametrize("context", [CROSS_RANK, RESHARDED])
@pytest.mark.parametrize("dtype", DTYPES)
def test_element_bound_edge(dtype, context):
    """k = bound steps on one element is decided as noise; bound + 1 is left to compare()."""
    ref = _ref(dtype, seed=1)
    kb = int(ulp_bound(dtype, context))
    for k_el, expect_fast in ((kb, True), (-kb, True), (kb + 1, False), (-(kb + 1), False)):
        k = torch.zeros(ref.shape, dtype=torch.int64)
        k[5, 17] = k_el
        f, c = _agree(_step(ref, k), ref, context)
        assert (f is not None) == expect_fast, (k_el, f, c["level"])
        if f is not None:
            assert c["level"] == "noise" and f["ulp_max"] == kb


@pytest.mark.parametrize("context", [CROSS_RANK, RESHARDED])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rel_norm_and_row_edges(dtype, context):
    """Sweeps that cross the whole-tensor and the worst-row bound: never a different verdict; both
    verdicts occur; the fast path decides the cases well inside."""
    ref = _ref(dtype, seed=2)
    kb = int(ulp_bound(dtype, context))
    g = torch.Generator().manual_seed(3)
    seen, fast_noise = set(), 0
    # whole tensor: every element moved by up to s steps, s chosen so rel_norm crosses the bound
    eps = torch.finfo(dtype).eps
    s_edge = rel_bound(dtype, context) / eps          # ~ steps per element at the bound
    for frac in [0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0]:
        s = s_edge * frac
        lo = int(s)
        k = lo + (torch.rand(ref.shape, generator=g) < (s - lo)).long()
        k = k.clamp(max=kb) * torch.where(torch.rand(ref.shape, generator=g) < 0.5, 1, -1)
        f, c = _agree(_step(ref, k), ref, context)
        seen.add(c["level"])
        fast_noise += f is not None
    # one row: its elements moved so that the worst row crosses its bound (rest of the tensor equal)
    r_edge = row_bound(dtype, context) / eps
    for frac in [0.3, 0.6, 0.9, 0.97, 1.0, 1.03, 1.1, 1.5, 2.5]:
        s = r_edge * frac
        lo = int(s)
        k = torch.zeros(ref.shape, dtype=torch.int64)
        k[9] = (lo + (torch.rand(ref.shape[1], generator=g) < (s - lo)).long()).clamp(max=kb)
        f, c = _agree(_step(ref, k), ref, context)
        seen.add(c["level"])
        fast_noise += f is not None
    assert fast_noise >= 3
    if dtype != torch.float32 or context == RESHARDED:        # fp32 cross-rank: kb steps stay far below rel
        assert seen == {"noise", "material"}, seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_zero_sign_left_to_compare(dtype):
    it, mag, inf = INT_VIEW[dtype]
    ref = _ref(dtype, seed=4)
    k = torch.zeros(ref.shape, dtype=torch.int64)
    k.view(-1)[::5] = 1
    base = _step(ref, k)
    nan = torch.tensor(float("nan"), dtype=dtype)
    cases = []
    x = base.clone(); x[0, 0] = nan; cases.append((x, ref))                          # NaN on x only
    r = ref.clone(); r[0, 0] = nan; x = base.clone(); x[0, 0] = nan; cases.append((x, r))   # NaN at the same place
    r = ref.clone(); r[1, 1] = float("inf"); x = base.clone(); x[1, 1] = float("inf"); cases.append((x, r))
    r = ref.clone(); r[1, 1] = torch.finfo(dtype).max; x = base.clone(); x[1, 1] = float("inf"); cases.append((x, r))
    r = ref.clone(); r[1, 1] = -torch.finfo(dtype).max; x = base.clone(); x[1, 1] = float("-inf"); cases.append((x, r))
    r = ref.clone(); r[2, 2] = 0.0; x = base.clone(); x[2, 2] = -0.0; cases.append((x, r))   # ±0
    r = ref.clone(); r[3, 3] = -0.0; x = ref.clone(); x[3, 3] = 0.0; cases.append((x, r))     # only ±0 differs
    tiny = torch.tensor(1, dtype=it).view(dtype)                                    # the smallest subnormal
    r = ref.clone(); r[4, 4] = tiny; x = base.clone(); x[4, 4] = -tiny; cases.append((x, r))  # sign change, 2 steps
    # bits that wrap in integer arithmetic: a NaN against -0 / the most negative subnormals
    r = ref.clone(); r.view(it)[5, 5] = torch.tensor(-(2 ** (8 * r.element_size() - 1)), dtype=it)
    x = ref.clone(); x.view(it)[5, 5] = torch.tensor(2 ** (8 * r.element_size() - 1) - 1,
                                                     dtype=it); cases.append((x, r))
    for x, r in cases:
        f, c = _agree(x, r)
        assert f is None or f["level"] == "bitwise", (f, c["level"])
    # and compare() itself tells them apart (the fast path defers to it, it does not guess)
    assert compare(cases[0][0], cases[0][1])["level"] == "material"
    assert compare(cases[1][0], cases[1][1])["level"] == "noise"
    assert compare(cases[6][0], cases[6][1])["level"] == "noise"


def test_shapes_dtypes_and_wide_rows():
    ref = _ref(torch.bfloat16)
    assert fast_level(ref, ref.float()) is None                  # two dtypes: compare() decides
    assert fast_level(ref[:2], ref) is None
    assert fast_level(ref.double(), ref.double()) is None         # no integer view
    big = torch.randn(2, 2_200_000).to(torch.bfloat16)             # float32 margin < 0.5 above ~2.1M columns
    assert fast_level(big, big.clone())["level"] == "bitwise"
    k = torch.zeros(big.shape, dtype=torch.int64); k[0, 0] = 1
    assert fast_level(_step(big, k), big) is None                 # rows too wide for the float32 margin
    x = torch.randn(600, 3000).to(torch.bfloat16)                 # several chunks of whole rows
    k = torch.zeros(x.shape, dtype=torch.int64); k.view(-1)[::3] = 1
    f, c = _agree(_step(x, k), x)
    assert f is not None and f["level"] == c["level"] == "noise"


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_has_nonfinite(dtype):
    t = _ref(dtype, seed=5)
    assert not has_nonfinite(t)
    for v in (float("nan"), float("inf"), float("-inf")):
        for pos in ((0, 0), (47, 159), (20, 3)):
            u = t.clone(); u[pos] = v
            assert has_nonfinite(u)
    m = t.clone(); m[0, 0] = torch.finfo(dtype).max; m[0, 1] = -torch.finfo(dtype).max
    assert not has_nonfinite(m)
    assert not has_nonfinite(torch.zeros(0, dtype=dtype)) and not has_nonfinite(torch.ones(3, dtype=torch.int64))
