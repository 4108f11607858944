"""The fused fingerprint kernels compile for every shape the probe can hand them, with no GPU.

A Triton kernel is compiled once per *specialization*: its constexprs, and for each runtime
argument whether it equals 1 (then it is a constant), is divisible by 16, or is a 16-byte-aligned
pointer.  A shape that produces a specialization nobody compiled can break at run time (16 to 63
bf16 tokens once did: ``nfull`` equal to 1 arrived as a Python int).  This test plans every shape
exactly as ``fingerprint.triton.launch`` does (``plan`` / ``calls``, on meta tensors: nothing is
allocated), asks Triton's own binder which specialization each launch causes, and compiles each
distinct one with Triton's compiler for sm_90 (the H100 / H200) and sm_80 (the A100), as
bench/kernel_asm.py does.  Shapes: tokens 1 to 65536 (tile remainders and primes), hidden 64 to
16384 (odd widths), fp32 / bf16 / fp16, contiguous and not.  The GPU tests that run the same
shapes against the torch path are in tests/unit/test_fingerprint.py (``-m gpu``).
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is pinned in ci/sglang-cpu; CI installs it")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import tpprobe.fingerprint.triton as tf  # noqa: E402
from tpprobe.fingerprint.triton import kernels  # noqa: E402
from tpprobe.fingerprint.reference import PROBE_K as FP_K, PROBE_SEED as FP_SEED  # noqa: E402

TOKENS = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 127, 128, 129, 251, 256, 257, 509,
          1021, 1024, 1031, 2039, 4093, 4096, 8191, 8192, 16381, 16384, 32749, 65521, 65536]
HIDDEN = [64, 96, 100, 127, 128, 130, 384, 1000, 1024, 2048, 4096, 5120, 7168, 8192, 12288, 16384]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GPUS = {90: 132, 80: 108}          # compute capability -> SMs (H100/H200, A100)


class _Ptr:
    """What Triton's binder reads of a tensor argument: its dtype and address."""

    def __init__(self, t: torch.Tensor, base: int = 0):
        self.dtype = t.dtype
        self.ptr = base + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self.ptr


def _arg(x):
    return _Ptr(x) if isinstance(x, torch.Tensor) else x


def specializations(cc: int, shapes, k: int = FP_K, seed: int = FP_SEED) -> dict:
    """{specialization key: (kernel, signature, constexprs, attrs, options, first shape)}."""
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binders = {}
    out = {}
    tune = tf.tuning()
    for shape, dtype in shapes:
        t = torch.empty(shape, dtype=dtype, device="meta")
        plans, ioff, foff, ntok = tf.plan([t], k, GPUS[cc], **tune)
        bufs = tf.buffers(ioff, foff, ntok, "meta")
        for kern, grid, args, kw in tf.calls(plans, bufs, seed, k, tune,
                                             signs=lambda kp: torch.empty(128, kp, device="meta")):
            if kern not in binders:
                binders[kern] = create_function_from_signature(kern.signature, kern.params, backend)
            bound, spec, opts = binders[kern](*map(_arg, args), **kw)
            options, sig, const, attrs = kern._pack_args(backend, kw, bound, spec, opts)
            key = (kern.__name__, repr(spec), repr(sorted(options.__dict__.items())))
            out.setdefault(key, (kern, sig, const, attrs, options, (shape, dtype)))
    return out


def compile_all(cc: int, specs: dict) -> list:
    errors = []
    for key, (kern, sig, const, attrs, options, first) in specs.items():
        try:
            triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", cc, 32),
                           options=options.__dict__)
        except Exception as e:     # noqa: BLE001 - reported with the shape that caused it
            errors.append(f"sm_{cc} {first}: {type(e).__name__}: {e}")
    return errors


def kernel_shapes(cc: int):
    """Every (shape, dtype) of the grid that the fused kernel takes on sm_cc; and the rest, with
    the reason each takes the torch path."""
    fused, torch_path = [], []
    for dt in DTYPES:
        esz = torch.empty((), dtype=dt).element_size()
        for n in TOKENS:
            for h in HIDDEN:
                for contiguous in (True, False):
                    why = tf.unsupported_reason((n, h), dt, esz, contiguous, 0, (cc // 10, cc % 10))
                    (torch_path if why else fused).append(((n, h), dt, why))
    return [(s, d) for s, d, _ in fused], torch_path


def test_the_sm90_kernels_compile_for_every_shape():
    fused, torch_path = kernel_shapes(90)
    # the grid covers the layouts the kernel refuses, each for its reason
    reasons = {why for _, _, why in torch_path}
    assert reasons == {"not contiguous", "odd byte count"}, reasons
    assert len(fused) > 1500
    # 1-D / 3-D tensors (no token flags), and the smallest and largest sketch (k 1 and 64: KP 4
    # and 64; the probe's k is 32)
    extra = [((6,), torch.bfloat16), ((2, 3, 128), torch.float16), ((65536 * 2,), torch.float32)]
    specs = specializations(90, fused)
    specs.update(specializations(90, extra))
    for k in (1, 64):
        specs.update(specializations(90, [((1024, 7168), torch.bfloat16)], k=k))
    # the sizes are runtime values: the whole grid causes a handful of specializations (one per
    # kernel, dtype, k and flag mode), so a new shape never means a new compile in a probe run
    assert len(specs) <= 12, sorted(k[:2] for k in specs)
    assert compile_all(90, specs) == []


def test_sm80_builds_fp32_and_16_bit_takes_the_torch_path():
    """Before Hopper the 16-bit kernel cannot build (max.u16x2 is sm_90 PTX): those tensors take
    the torch path and the probe says so; the fp32 kernel builds on sm_80 for every shape."""
    fused, torch_path = kernel_shapes(80)
    assert fused and all(dt == torch.float32 for _, dt in fused)
    bf16 = [why for (s, dt, why) in torch_path if dt == torch.bfloat16]
    assert bf16 and all("sm_80" in w and "sm_90" in w for w in bf16)
    assert compile_all(80, specializations(80, fused)) == []
    # the rule is the compiler's: the 16-bit kernel really fails to build for sm_80
    errors = compile_all(80, specializations(80, [((64, 7168), torch.bfloat16)]))
    assert len(errors) == 1 and "u16x2" in errors[0], errors


def test_cuda_tensors_the_kernel_cannot_take_are_named(monkeypatch):
    """The dispatch on a pre-Hopper GPU: the torch path, and the reason recorded once (CPU test of
    the rule; the GPU tests run both paths on real tensors)."""
    from tpprobe.fingerprint import reference as F
    monkeypatch.setattr(F, "TORCH_PATH", {})
    F._torch_path(tf.unsupported_reason((16, 7168), torch.bfloat16, 2, True, 0, (8, 0)))
    F._torch_path(tf.unsupported_reason((16, 7168), torch.bfloat16, 2, True, 0, (8, 0)))
    assert F.TORCH_PATH == {"bfloat16 on sm_80: the kernel needs sm_90 (max.u16x2)": 2}
    assert tf.unsupported_reason((16, 7168), torch.bfloat16, 2, True, 0, (9, 0)) == ""
    assert tf.unsupported_reason((3, 7), torch.bfloat16, 2, True, 0, (9, 0)) == "odd byte count"
    assert math.prod((3, 7)) == 21


def test_the_direct_launch_hands_the_launcher_what_jit_run_binds():
    """After a shape's first launch, `Batch` calls the CompiledKernel's launcher itself with
    integer addresses and its cached integer / constexpr arguments: they must be, position by
    position, the ``bound_args.values()`` JITFunction.run would pass (Triton's binder, as above),
    and cause the same specialization whatever the batch offset (every pointer 16-byte aligned)."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for shape, dtype in [((1, 7168), torch.bfloat16), ((64, 7168), torch.float16), ((33, 130), torch.bfloat16),
                         ((5, 100), torch.float32), ((8192, 7168), torch.float32), ((6,), torch.bfloat16)]:
        b = tf.Batch(FP_SEED, FP_K)
        e = b.entry(torch.empty(shape, dtype=dtype))
        assert not e.why and e.words % 2 == 0
        binder = create_function_from_signature(e.kern.signature, e.kern.params, backend)
        specs = set()
        for off in (0, 2, 1000, 123456):          # word offsets of the launch's slice of a batch
            buf = torch.empty(off + e.words, dtype=torch.int64, device="meta")
            ipart, fpart, flags = tf.split_buffer(buf[off:], e.ni, 2 * e.nf)
            t = torch.empty(shape, dtype=dtype, device="meta").view(-1).view(torch.int32)
            args = [_Ptr(x, base=1 << 20) for x in (t, e.sign, fpart, ipart, flags)] + list(e.ints)
            bound, spec, _ = binder(*args, **e.kw)
            specs.add(repr(spec))
            base = (1 << 20) + off * 8
            direct = [1 << 20, None, base + e.ni * 8, base, base + (e.ni + e.nf) * 8, *e.tail]
            values = list(bound.values())
            assert len(values) == len(direct), (shape, dtype)
            assert [v.data_ptr() for v in values[2:5]] == direct[2:5]
            assert values[5:] == direct[5:], (shape, dtype)
        assert len(specs) == 1, (shape, dtype, specs)


def _combine_specs(cc: int) -> dict:
    """The device combine's specializations: k 1 / 32 / 64 (the probe's 32; KP 4 to 64), as
    `Batch` launches it (combine_call), every pointer 16-byte aligned."""
    backend = make_backend(GPUTarget("cuda", cc, 32))
    kern = kernels.combine_kernel
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    out = {}
    for k in (1, 32, 64):
        for kp in sorted({tf.padded_k(k, dt) for dt in DTYPES}):
            desc = torch.empty(250, tf.DESC, dtype=torch.int64, device="meta")
            base, res = (torch.empty(n, dtype=torch.int64, device="meta") for n in (1 << 20, 4096))
            _, _, args, kw = tf.combine_call(desc, base, res, 250, k, kp)
            bound, spec, opts = binder(*map(_arg, args), **kw)
            options, sig, const, attrs = kern._pack_args(backend, kw, bound, spec, opts)
            out.setdefault((repr(spec), repr(sorted(options.__dict__.items()))), (kern, sig, const, attrs, options,
                                                                                  (k, kp)))
    return out


@pytest.mark.parametrize("cc", [90, 80])
def test_the_device_combine_compiles_for_sm90_and_sm80(cc):
    """The combine (float64 sums, a bitmap per tensor) builds wherever a fused kernel runs; k is a
    runtime value, so one binary per column block (CB 8 / 32 / 64 / 128 for KP 4 / 16 / 32 / 64)
    serves every batch."""
    specs = _combine_specs(cc)
    assert len(specs) == 4, sorted(v[5] for v in specs.values())
    assert compile_all(cc, specs) == []


def test_the_combine_direct_launch_hands_the_launcher_what_jit_run_binds():
    """`Batch._combine_run` calls the combine's launcher with integer addresses after the first
    launch: position by position what JITFunction.run binds, one specialization at any address."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kern = kernels.combine_kernel
    binder = create_function_from_signature(kern.signature, kern.params, backend)
    specs = set()
    for at in (0, 16, 4096, 1 << 30):
        desc = torch.empty(7, tf.DESC, dtype=torch.int64, device="meta")
        base, res = (torch.empty(n, dtype=torch.int64, device="meta") for n in (1 << 16, 512))
        _, _, args, kw = tf.combine_call(desc, base, res, 7, FP_K, 32)
        ptrs = [_Ptr(x, base=(1 << 20) * (i + 1) + at) for i, x in enumerate(args[:7])]
        bound, spec, _ = binder(*ptrs, *args[7:], **kw)
        specs.add(repr(spec))
        values = list(bound.values())
        d, b, o = ptrs[0].ptr, ptrs[1].ptr, ptrs[4].ptr
        direct = [d, b, b, b, o, o, o, FP_K, *tf.constexpr_args(kern, len(args), kw)]
        assert [v.data_ptr() for v in values[:7]] == [p.ptr for p in ptrs]
        assert values[7:] == direct[7:] and len(values) == len(direct)
    assert len(specs) == 1, specs


class _allocation:                # triton.runtime._allocation, as Triton 3.6's launcher reads it
    _allocator = _profile_allocator = None


class _Launcher36:
    """Triton 3.6's CudaLauncher, as its source reads (the form `launch_of` calls through)."""
    global_scratch_size = global_scratch_align = profile_scratch_size = profile_scratch_align = 0
    launch_cooperative_grid, launch_pdl, num_ctas = False, True, 1

    def __init__(self):
        self.calls = []
        self.launch = lambda *a: self.calls.append(a)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):

        def allocate_scratch(size, align, allocator):
            if size > 0:
                grid_size = gridX * gridY * gridZ
                alloc_size = grid_size * self.num_ctas * size
                alloc_fn = allocator.get()
                return alloc_fn(alloc_size, align, stream)
            return None

        global_scratch = allocate_scratch(self.global_scratch_size, self.global_scratch_align, _allocation._allocator)
        profile_scratch = allocate_scratch(self.profile_scratch_size, self.profile_scratch_align,
                                           _allocation._profile_allocator)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _Compiled:
    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, "fn", "meta"


def test_launch_of_calls_the_c_launch_only_for_triton_3_6s_exact_launcher():
    run = _Launcher36()
    launch, middle = tf.launch_of(_Compiled(run))
    assert launch is run.launch and middle == (False, True, None, None, "meta", None, None, None)
    # the C launch gets exactly what the launcher's own __call__ would have handed it
    run(4, 1, 1, 7, "fn", "meta", None, None, None, 11, 12)
    launch(4, 1, 1, 7, "fn", *middle, 11, 12)
    assert run.calls[0] == run.calls[1]
    run.global_scratch_size = 8                       # a kernel that needs scratch: the launcher
    assert tf.launch_of(_Compiled(run)) == (run, ("meta", None, None, None))

    class Other(_Launcher36):                         # any other form (another Triton): the launcher
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_pdl, *args)
    other = Other()
    assert tf.launch_of(_Compiled(other)) == (other, ("meta", None, None, None))
