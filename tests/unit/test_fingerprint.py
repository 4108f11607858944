"""Fingerprint layer: exact bit hash, linear sketch, completeness rule.

The default suite runs on CPU; the tests marked `gpu` compare the Triton kernels with the CUDA
torch path on a GPU machine (`pytest -m gpu tests/unit/test_fingerprint.py`)."""
import json
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tpprobe.fingerprint.reference import (Fingerprint, column_signs, fingerprint, fingerprints, row_signs,
                                           sketch_close, sum_matches)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ----------------------------------------------------------------- bit hash
def _flip_bit(t: torch.Tensor, elem: int, bit: int) -> torch.Tensor:
    u = t.clone().reshape(-1)
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[u.element_size()]
    w = u.view(iv)
    top = bit == 8 * u.element_size() - 1 and iv != torch.uint8
    w[elem] = w[elem] ^ (torch.iinfo(iv).min if top else (1 << bit))
    return u.view(t.shape)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 700), dt=st.sampled_from(DTYPES + [torch.float64, torch.int8]),
       data=st.data())
def test_hash_one_bit_flip_differs(n, dt, data):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 3).to(dt)
    elem = data.draw(st.integers(0, n - 1))
    bit = data.draw(st.integers(0, 8 * t.element_size() - 1))
    u = _flip_bit(t, elem, bit)
    assert not torch.equal(t.view(-1).view(torch.uint8), u.view(-1).view(torch.uint8))
    assert fingerprint(t).bit_hash != fingerprint(u).bit_hash
    assert fingerprint(t).bit_hash == fingerprint(t.clone()).bit_hash


@pytest.mark.parametrize("dt", DTYPES)
def test_hash_one_ulp_and_signed_zero(dt):
    t = torch.randn(33, 130).to(dt)
    u = t.clone()
    u[5, 7] = torch.nextafter(u[5, 7].float(), torch.tensor(math.inf)).to(dt) \
        if dt == torch.float32 else _flip_bit(t, 5 * 130 + 7, 0)[5, 7]
    assert fingerprint(t).bit_hash != fingerprint(u).bit_hash
    z = torch.zeros(17, 9, dtype=dt)
    nz = z.clone()
    nz[3, 4] = -0.0
    assert torch.equal(z, nz)                                  # equal as numbers...
    assert fingerprint(z).bit_hash != fingerprint(nz).bit_hash  # ...not as bits
    assert fingerprint(z).bit_hash != fingerprint(-z).bit_hash


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 400), seed=st.integers(0, 2**31))
def test_hash_permutation_differs(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g).bfloat16()
    p = torch.randperm(n, generator=g)
    u = t[p]
    if torch.equal(u.view(torch.int16), t.view(torch.int16)):
        return
    assert fingerprint(t).bit_hash != fingerprint(u).bit_hash


def test_hash_swap_two_and_shape_independent_of_seed():
    t = torch.randn(64, 256)
    u = t.clone()
    u[0, 0], u[63, 255] = t[63, 255], t[0, 0]
    assert fingerprint(t).bit_hash != fingerprint(u).bit_hash
    assert fingerprint(t, seed=1).bit_hash == fingerprint(t, seed=2).bit_hash
    assert len(fingerprint(t).bit_hash) == 32
    int(fingerprint(t).bit_hash, 16)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_cuda_word_hash_changes_both_lanes(n, data):
    """The CUDA hash (the torch reference of the Triton kernels, computed here on CPU): changing
    any one word changes both lanes; swapping the two words of a pair or words of different
    pairs, or appending a zero word, changes them too (odd counts are zero-padded, so shapes,
    compared separately, tell those apart)."""
    from tpprobe.fingerprint.reference import M32, _hash_words
    g = torch.Generator().manual_seed(n)
    w = torch.randint(0, 2 ** 32, (n,), generator=g, dtype=torch.int64)
    base = _hash_words(w, 0)
    i = data.draw(st.integers(0, n - 1))
    v = data.draw(st.integers(0, M32).filter(lambda x: x != int(w[i])))
    u = w.clone()
    u[i] = v
    a, b = _hash_words(u, 0)
    assert a != base[0] and b != base[1]
    if n >= 2:
        j = data.draw(st.integers(0, n - 1).filter(lambda x: int(w[x]) != int(w[i])))
        u = w.clone()
        u[i], u[j] = w[j], w[i]
        assert _hash_words(u, 0) != base
    assert _hash_words(w, 2) != base                     # the position is hashed in


def test_noncontiguous_equals_contiguous():
    t = torch.randn(300, 64).bfloat16()
    assert fingerprint(t.t()).bit_hash == fingerprint(t.t().contiguous()).bit_hash


# ----------------------------------------------------------------- sketch
def test_sketch_matches_definition():
    k, seed = 40, 7
    x = torch.randn(300, dtype=torch.float64)   # 2 full sign rows + a partial one
    A = column_signs(seed, k)
    B = row_signs(torch.arange(3), seed, k)
    want = [sum(float(A[i % 128, j] * B[i // 128, j] * x[i]) for i in range(300)) for j in range(k)]
    got = fingerprint(x, seed=seed, k=k).sketch
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert set(A.unique().tolist()) == {-1.0, 1.0} and set(B.unique().tolist()) == {-1.0, 1.0}
    # signs are balanced and the seeds decorrelate
    assert abs(float(A.mean())) < 0.1
    assert fingerprint(x, seed=seed + 1, k=k).sketch != got


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), c=st.floats(-4, 4),
       seed=st.integers(0, 2**40))
def test_sketch_linearity(rows, cols, c, seed):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    a = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    b = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    fa, fb = fingerprint(a, seed=seed), fingerprint(b, seed=seed)
    fs = fingerprint(a + c * b, seed=seed)
    scale = math.sqrt(fa.sumsq + fb.sumsq) * (1 + abs(c))
    for s, x, y in zip(fs.sketch, fa.sketch, fb.sketch):
        assert abs(s - (x + c * y)) <= 1e-12 * scale


def _ar_inputs(m, shape, dt, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.empty(m).uniform_(0.3, 3.0, generator=g)   # realistic, unequal shares
    return [(torch.randn(*shape, generator=g) * s).to(dt) for s in scales]


def _orders(ins):
    """The same all-reduce in several reduction orders / precisions."""
    dt = ins[0].dtype
    outs = [torch.stack([x.float() for x in ins]).sum(0).to(dt)]        # fp32 accumulate
    acc = ins[0]
    for x in ins[1:]:
        acc = acc + x                                                   # ring order, in dtype
    outs.append(acc)
    acc = ins[-1]
    for x in reversed(ins[:-1]):
        acc = acc + x                                                   # reversed ring
    outs.append(acc)
    if len(ins) == 4:
        outs.append((ins[0] + ins[2]) + (ins[3] + ins[1]))              # tree
    return outs


CASES = [(2, (64, 256)), (4, (128, 1024)), (2, (512, 512)), (4, (256, 384)), (8, (64, 768))]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,shape", CASES)
def test_sum_matches_reduction_orders(dt, m, shape):
    ins = _ar_inputs(m, shape, dt, seed=m * 7 + shape[0])
    in_fps = fingerprints(ins)
    for out in _orders(ins):
        ok, rel = sum_matches(fingerprint(out), in_fps, dt)
        assert ok, (dt, m, shape, rel)
    # shuffled rank order on the input side is the same sum
    ok, _ = sum_matches(fingerprint(_orders(ins)[0]), in_fps[::-1], dt)
    assert ok


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,shape", CASES)
def test_sum_matches_rejects_missing_share(dt, m, shape):
    for trial in range(2 if shape[0] * shape[1] <= 2**17 else 1):
        ins = _ar_inputs(m, shape, dt, seed=1000 * trial + m * 7 + shape[0])
        in_fps = fingerprints(ins)
        drop = {2: [[0], [1]], 4: [[0, 1], [2, 3], [1], [0, 3]], 8: [[0], [5, 6]]}[m]
        for d in drop:
            kept = [x for i, x in enumerate(ins) if i not in d]
            partial = torch.stack([x.float() for x in kept]).sum(0).to(dt)
            ok, rel = sum_matches(fingerprint(partial), in_fps, dt)
            assert not ok, (dt, m, shape, d, rel)
        # a share counted twice is wrong too
        doubled = (torch.stack([x.float() for x in ins]).sum(0) + ins[0].float()).to(dt)
        assert not sum_matches(fingerprint(doubled), in_fps, dt)[0]


def test_sum_matches_edge_cases():
    z = torch.zeros(4, 128)
    assert sum_matches(fingerprint(z), [fingerprint(z), fingerprint(z)], torch.float32) == (True, 0.0)
    a = torch.randn(4, 128)
    assert not sum_matches(fingerprint(a), [fingerprint(z), fingerprint(z)], torch.float32)[0]
    assert not sum_matches(fingerprint(a), [fingerprint(a[:2])], torch.float32)[0]   # shape
    n = a.clone()
    n[0, 0] = float("nan")
    ok, rel = sum_matches(fingerprint(n), [fingerprint(a)], torch.float32)
    assert not ok and math.isnan(rel)


@pytest.mark.parametrize("dt", DTYPES)
def test_sketch_close(dt):
    x = torch.randn(256, 512)
    y = torch.randn(256, 512)
    a = (x + y).to(dt)
    b = (x.to(dt) + y.to(dt))                     # same values, different rounding history
    assert sketch_close(fingerprint(a), fingerprint(b), dt)
    assert sketch_close(fingerprint(a), fingerprint(a.clone()), dt)
    c = a.clone()
    c[::8] *= 1.5                                 # 1/8 of the token rows diverge materially
    assert not sketch_close(fingerprint(a), fingerprint(c), dt)
    # a single row of 256 scaled by 1.5 moves the norm by ~3%: below bf16 noise
    # resolution of a global sketch; bit_hash differs, which routes it to the
    # detailed diff (sketch_close only says "no evidence beyond noise").
    d = a.clone()
    d[17] *= 1.5
    assert fingerprint(d).bit_hash != fingerprint(a).bit_hash
    assert not sketch_close(fingerprint(a), fingerprint(x.to(dt)), dt)


# ----------------------------------------------------------------- stats, bitmap, json
def test_nan_inf_counts_and_stats():
    t = torch.randn(20, 130)
    t[1, 2] = float("nan")
    t[3, 4] = float("nan")
    t[5, 6] = float("inf")
    t[7, 8] = -float("inf")
    t[9, 9] = 1e3
    fp = fingerprint(t.bfloat16())
    assert (fp.n_nan, fp.n_inf) == (2, 2)
    assert fp.absmax == math.inf
    f2 = fingerprint(torch.tensor([[1.0, -7.5], [float("nan"), 2.0]]))
    assert f2.absmax == 7.5 and f2.n_nan == 1 and math.isnan(f2.sumsq)
    f3 = fingerprint(torch.tensor([3.0, -4.0]))
    assert f3.sumsq == 25.0 and f3.absmax == 4.0 and f3.row_nonzero == ""


def test_row_bitmap():
    t = torch.randn(19, 256).bfloat16()
    zero_rows = [0, 3, 8, 18]
    t[zero_rows] = 0
    t[3, 255] = -0.0                              # -0.0 is zero
    fp = fingerprint(t)
    assert fp.nonzero_rows() == [r not in zero_rows for r in range(19)]
    assert len(fp.row_nonzero) == 2 * math.ceil(19 / 8)
    assert fingerprint(torch.randn(3, 4, 5)).row_nonzero == ""
    t[0, 100] = float("nan")                      # NaN is not zero
    assert fingerprint(t).nonzero_rows()[0]


def test_json_round_trip_and_size():
    t = torch.randn(8192 // 8, 7168 // 8).bfloat16()
    t[0, 0] = float("inf")
    for k in (16, 32, 64):
        fp = fingerprint(t, seed=3, k=k)
        s = json.dumps(fp.to_json())
        assert len(s) < 4096, len(s)
        back = Fingerprint.from_json(json.loads(s))
        assert back == fp
        assert back.k == k
    with pytest.raises(ValueError):
        fingerprint(t, k=65)


_CHILD = """
import json, torch
from tpprobe.fingerprint.reference import fingerprint
g = torch.Generator().manual_seed(1234)
t = torch.randn(100, 300, generator=g).bfloat16()
print(json.dumps(fingerprint(t, seed=99, k=24).to_json()))
"""


def test_deterministic_across_processes():
    g = torch.Generator().manual_seed(1234)
    t = torch.randn(100, 300, generator=g).bfloat16()
    here = fingerprint(t, seed=99, k=24).to_json()
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True)
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == json.loads(json.dumps(here))


def test_chunking_invariance(monkeypatch):
    import tpprobe.fingerprint.reference as F
    t = torch.randn(77, 333)
    a = fingerprint(t)
    monkeypatch.setattr(F, "_CHUNK_ROWS", 3)
    b = fingerprint(t)
    assert a.bit_hash == b.bit_hash and (a.n_nan, a.row_nonzero) == (b.n_nan, b.row_nonzero)
    assert a.sketch == pytest.approx(b.sketch, rel=1e-12, abs=1e-9)


# ----------------------------------------------------------------- fused Triton path (GPU only)
def _has_triton_cuda():
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


# These run on a GPU machine (`pytest -m gpu`, see docs/benchmarks.md); the default suite
# deselects them (pyproject addopts), so a CPU run never shows them as skipped.
@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 7168), (64, 256), (300, 130), (5, 100), (3, 7, 8), (1, 2)])
def test_triton_matches_torch(dt, shape):
    import tpprobe.fingerprint.triton as tf
    from tpprobe.fingerprint.reference import _fingerprint_torch
    g = torch.Generator(device="cuda").manual_seed(shape[0])
    t = (torch.randn(*shape, device="cuda", generator=g) * 2).to(dt)
    if t.dim() == 2 and shape[0] > 8:
        t[3] = 0
        t[7, -1] = -0.0
    if not tf.supported(t):
        pytest.skip("odd byte count: torch path")
    for k in (16, 32, 64):
        f = tf.fingerprint_batch([t], seed=11, k=k)[0]
        assert _has_triton_cuda()
        on_cuda = _fingerprint_torch(t, 11, k)
        assert f.bit_hash == on_cuda.bit_hash
        # the CPU path hashes with blake2b (hashes are only compared between ranks of one run,
        # which share a device type); every other field must agree with it too
        for r in (on_cuda, _fingerprint_torch(t.cpu(), 11, k)):
            assert (f.n_nan, f.n_inf, f.row_nonzero, f.shape, f.dtype) == \
                (r.n_nan, r.n_inf, r.row_nonzero, r.shape, r.dtype)
            assert f.absmax == r.absmax
            assert f.sumsq == pytest.approx(r.sumsq, rel=1e-5)
            scale = math.sqrt(r.sumsq)
            assert max(abs(a - b) for a, b in zip(f.sketch, r.sketch)) <= 2e-6 * scale
            assert sketch_close(f, r, dt) and sum_matches(f, [r], dt)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(maxnreg=120, progs_per_sm=4), dict(depth=2),
                                 dict(depth=2, maxnreg=96, progs_per_sm=5), dict(maxnreg=0, progs_per_sm=1),
                                 dict(split=1, block_r=8, progs_per_sm=5),
                                 dict(split=1, block_r=8, depth=2, progs_per_sm=6),
                                 dict(num_warps=8, block_r=32, depth=2, progs_per_sm=2)])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_triton_configs_match_torch(cfg, dt):
    """The tuning knobs (tile rows, warps, programs per SM, register cap) change the schedule,
    never the result: odd tile counts, the pairs loop, the masked tail."""
    import tpprobe.fingerprint.triton as tf
    from tpprobe.fingerprint.reference import _fingerprint_torch
    for shape in [(1000, 7168), (97, 384), (33, 256)]:
        t = (torch.randn(*shape, device="cuda") * 3).to(dt)
        t[5] = 0
        f = tf.fingerprint_batch([t], seed=5, k=32, **cfg)[0]
        r = _fingerprint_torch(t, 5, 32)
        assert (f.bit_hash, f.row_nonzero, f.absmax) == (r.bit_hash, r.row_nonzero, r.absmax)
        assert f.sumsq == pytest.approx(r.sumsq, rel=1e-5)
        assert max(abs(a - b) for a, b in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_nan_inf_counts(dt):
    from tpprobe.fingerprint.reference import _fingerprint_torch
    t = torch.randn(300, 1024, device="cuda").to(dt)
    t[1, 2], t[3, 4], t[5, 6], t[7, 8] = float("nan"), float("inf"), -float("inf"), float("nan")
    f = fingerprint(t)
    r = _fingerprint_torch(t, 0, 32)
    assert (f.bit_hash, f.n_nan, f.n_inf, f.absmax, f.row_nonzero) == \
        (r.bit_hash, 2, 2, math.inf, r.row_nonzero)
    assert math.isnan(f.sumsq) and math.isnan(r.sumsq)


@pytest.mark.gpu
def test_triton_nan_inf_and_dispatch():
    from tpprobe.fingerprint.reference import _fingerprint_torch
    assert _has_triton_cuda()
    t = torch.randn(256, 512, device="cuda").bfloat16()
    t[1, 2] = float("nan")
    t[3, 4] = float("inf")
    f = fingerprint(t)
    r = _fingerprint_torch(t, 0, 32)          # the CUDA torch path: same word-mixer hash
    assert f.bit_hash == r.bit_hash and (f.n_nan, f.n_inf) == (1, 1) and f.absmax == math.inf
    ins = _ar_inputs(4, (512, 1024), torch.bfloat16, 3)
    ins = [x.cuda() for x in ins]
    fps = fingerprints(ins)
    assert sum_matches(fingerprint(torch.stack(ins).float().sum(0).bfloat16()), fps, torch.bfloat16)[0]
    assert not sum_matches(fingerprint(torch.stack(ins[1:]).float().sum(0).bfloat16()), fps,
                           torch.bfloat16)[0]


# every shape class of tests/unit/test_kernel_compile.py, run: tokens 1..65536 with tile remainders
# and primes against a few widths, every width (odd ones too) against a few token counts, the
# three dtypes, contiguous and not (a transposed view takes the torch path, the same answer)
_GRID_TOKENS = [1, 2, 3, 7, 16, 17, 31, 33, 47, 63, 64, 65, 127, 129, 251, 509, 1021, 4093, 8191, 16381, 65521, 65536]
_GRID_HIDDEN = [64, 96, 100, 127, 128, 130, 384, 1000, 5120, 7168, 12288, 16384]
_GRID = sorted({(n, h) for n in _GRID_TOKENS for h in (128, 7168)} |
               {(n, h) for n in (1, 17, 63, 1031) for h in _GRID_HIDDEN})


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPES)
def test_every_shape_matches_the_torch_path(dt):
    from tpprobe.fingerprint.reference import _fingerprint_torch
    bad = []
    for n, h in _GRID:
        if n * h > 2 ** 28:
            continue                      # 65536 x 7168 and up: the sizes the 8192 x 7168 case covers
        base = (torch.randn(n, h, device="cuda") * 2).to(dt)
        for t in (base, base.t()):        # contiguous, and a transposed (non-contiguous) view
            f = fingerprints([t], seed=3, k=32)[0]
            r = _fingerprint_torch(t, 3, 32)
            ok = (f.bit_hash == r.bit_hash and f.row_nonzero == r.row_nonzero and f.absmax == r.absmax
                  and abs(f.sumsq - r.sumsq) <= 1e-5 * r.sumsq
                  and max(abs(a - b) for a, b in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq))
            if not ok:
                bad.append((tuple(t.shape), t.is_contiguous()))
    assert bad == []


@pytest.mark.gpu
def test_fingerprint_mode_never_syncs_the_host_inside_the_forward():
    """--exchange fingerprint's capture: every fingerprint queued during the forward with no
    device-to-host copy or stream sync (CUDA's sync debug mode raises on one), all read after it
    with one copy."""
    from tpprobe.capture.hooks import Tap
    from tpprobe.fingerprint.reference import Deferred, _fingerprint_torch, resolved
    from tpprobe.engines.builtin.model import BuiltinConfig, TPModel, full_weights, input_ids
    from tpprobe.core.target import RankContext
    cfg = BuiltinConfig(num_layers=4, hidden=1024, heads=8, ffn=2048, vocab=512, tokens=17, dtype=torch.bfloat16)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend="none")
    model = TPModel(full_weights(cfg), ctx, cfg).cuda().eval()
    ids = input_ids(cfg).cuda()
    for sync_mode in (0, 2):          # a warm-up (compiles, caches the signs), then "error" on any sync
        fp = Deferred(7, 32)
        with torch.no_grad(), Tap(model, keep=lambda n: False, summarize=fp, keep_allreduce_tensors=False) as tap:
            torch.cuda.set_sync_debug_mode(sync_mode)
            try:
                model(ids)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # the 4 layers' hidden + residual sums are the Tap's own: their launches wait for the read
        assert len(fp.batch.later) == 4
        fp.resolve()
    got = {n: resolved(v) for n, v in tap.summaries.items()}
    assert len(got) >= 5 and all(f is not None for f in got.values())
    with torch.no_grad(), Tap(model, keep=lambda n: True, keep_allreduce_tensors=False) as ref:
        model(ids)
    for n, t in ref.captures.items():
        if n in got:
            assert got[n].bit_hash == _fingerprint_torch(t, 7, 32).bit_hash, n


@pytest.mark.gpu
def test_device_combine_equals_the_host_combine_to_the_bit():
    """A forward's batch combined on the device (`_combine_kernel`, the default) and on the host
    (`combine_many`, TPPROBE_FP_HOST_COMBINE=1; a CUDA-graph tap's read): the same fingerprints to
    the bit, over 4 to 396 programs a tensor (decode to prefill sizes), several tensors of a shape
    and several shapes in one batch, token flags and torch-side row flags, NaN / Inf, fp32 / bf16 /
    fp16; a partial read (``only``); and all of it again with every other launch made by the read
    (``take(later=True)``, a tensor the Tap owns)."""
    import tpprobe.fingerprint.triton as tf
    g = torch.Generator(device="cuda").manual_seed(5)
    ts = []
    for dt in DTYPES:
        for shape in [(1, 7168), (8, 7168), (64, 7168), (8192, 7168), (300, 130), (17, 384), (6,)]:
            for rep in range(2):
                t = (torch.randn(*shape, device="cuda", generator=g) * 10 ** rep).to(dt)
                if t.dim() == 2 and shape[0] > 8:
                    t[3] = 0
                    if rep:
                        t[5, 1], t[7, 2], t[8, 0] = float("nan"), float("inf"), -float("inf")
                ts.append(t)

    def read(host_combine, only=None, later=False):
        # later: every other tensor's launch made by the read (take(later=True)), not when queued
        b = tf.Batch(9, 32, host_combine=host_combine)
        items = [b.take(t, later=later and i % 2 == 1) for i, t in enumerate(ts)]
        assert all(it is not None for it in items) and len(b.later) == (len(ts) // 2 if later else 0)
        b.read(None if only is None else {id(items[i]) for i in only})
        assert b.later == []
        return [None if it.fp is None else json.dumps(it.fp.to_json()) for it in items]
    dev, host = read(False), read(True)
    assert not tf.STATE.combine_why, tf.STATE.combine_why
    assert [i for i, (a, b) in enumerate(zip(dev, host)) if a != b] == []
    only = list(range(1, len(ts), 4))
    part = read(False, only)
    assert [i for i, v in enumerate(part) if v is not None] == only and all(part[i] == dev[i] for i in only)
    # launched by the read: the same fingerprints to the bit, both combines, whole and partial reads
    # (a partial read launches only the wanted ones: the others stay unread)
    assert read(False, later=True) == dev and read(True, later=True) == dev
    part = read(False, only, later=True)
    assert [i for i, v in enumerate(part) if v is not None] == only and all(part[i] == dev[i] for i in only)


@pytest.mark.gpu
def test_native_launch_equals_the_python_launch_to_the_bit(monkeypatch):
    """The launch from C (`Deferred.fast()`, fingerprint/triton/native.c) against the Python path, on
    the same tensors: the same fingerprints to the bit, queued now and queued for the read
    (``later``), with the batch's buffer full every few launches (a new one made from C), decode
    and prefill sizes of three dtypes; a shape whose row flags torch makes (width 130), a first
    tensor of a shape and a Deferred's first tensor (it starts the batch) stay on the Python path,
    and the C path takes every other one."""
    import tpprobe.fingerprint.triton as tf
    from tpprobe.fingerprint.reference import Deferred
    from tpprobe.fingerprint.triton import native
    monkeypatch.setenv("TPPROBE_NATIVE", "1")
    if native.NATIVE is None:
        monkeypatch.setattr(native, "_TRIED", False)
    tf.Batch(9, 32)                     # a batch on the GPU builds the C module, once per process
    assert native.NATIVE is not None, native.WHY
    monkeypatch.setattr(tf.Batch, "CHUNK", 512)       # a new buffer every few launches
    g = torch.Generator(device="cuda").manual_seed(11)
    ts = []
    for dt in DTYPES:
        for shape in [(1, 7168), (8, 7168), (64, 7168), (2048, 7168), (300, 130), (17, 384), (2, 3, 256)]:
            t = torch.randn(*shape, device="cuda", generator=g).to(dt)
            if shape[0] == 64:
                t[5, 1] = float("nan")
            ts.append(t)

    def run(fast):
        d = Deferred(9, 32)
        f = d.fast() if fast else d
        got = [f.later(t.clone()) if i % 3 == 2 else f(t) for i, t in enumerate(ts)]
        d.resolve()
        return f, [json.dumps(x.fp.to_json()) for x in got]
    run(False)                          # every shape's entry (and its C launch) made
    py = run(False)[1]
    f, c = run(True)
    assert type(f).__name__ == "Taker"
    assert [i for i, (a, b) in enumerate(zip(py, c)) if a != b] == []
    narrow = sum(1 for t in ts if t.shape[-1] == 130)
    # from C: every tensor but the torch-flagged shape's and the first (its call starts the batch)
    assert f.taken == len(ts) - narrow - 1

    # a checked forward of the built-in model: the Tap's calls go to C, its fingerprints are the
    # Python path's to the bit
    from tpprobe.capture.hooks import Tap
    from tpprobe.engines.builtin.model import BuiltinConfig, TPModel, full_weights, input_ids
    from tpprobe.core.target import RankContext
    cfg = BuiltinConfig(num_layers=4, hidden=1024, heads=8, ffn=2048, vocab=512, tokens=17, dtype=torch.bfloat16)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend="none")
    model = TPModel(full_weights(cfg), ctx, cfg).cuda().eval()
    ids = input_ids(cfg).cuda()
    seen = []
    for native_on in (False, True, False, True):
        d = Deferred(7, 32)
        fast = d.fast
        if not native_on:
            monkeypatch.setattr(d, "fast", lambda: d)
        with torch.no_grad(), Tap(model, keep=lambda n: False, summarize=d, keep_allreduce_tensors=False) as tap:
            model(ids)
        d.resolve()
        assert (type(tap.summarize).__name__ == "Taker") == native_on, fast
        if native_on:      # every point from C but the first (its call starts the forward's batch)
            assert tap.summarize.taken == len(tap.summaries) - 1
        seen.append({n: json.dumps(v.fp.to_json()) for n, v in tap.summaries.items()})
    assert len(seen[0]) >= 5 and seen[1] == seen[0] and seen[3] == seen[2] == seen[0]
