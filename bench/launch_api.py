"""One kernel launched between the model's ops through the driver's cuLaunchKernel and through the runtime's
cudaLaunchKernel (the call aten's kernels go through), against the same launches alone.

    python bench/launch_api.py [--tokens 1] [--rounds 150] [--out DIR]

The bare decode forward of bench/in_forward.py (the 9 all-reduces over a world-1 NCCL group, no Tap); a
forward hook on each all-reducing module launches a one-program Triton kernel twice, per variant:
  off      nothing
  driver   cuLaunchKernel(CUfunction), through ctypes
  runtime  cudaLaunchKernel(cudaKernel_t from cudaLibraryLoadData of the same cubin), through ctypes
  taker    the fingerprint of the reduced output from the C Taker (fingerprint/triton/native.c), its batch
           started before the forward: what the checked forward's collectives pay per fingerprint
  later1   the same kernel, the same parameters, through native.launch_later of one queued Item: the
           launch with none of the Taker's lookups and records
  props    the tensor's properties the Taker reads (is_cuda, shape, dtype, get_device(), data_ptr(),
           is_contiguous()), from Python
The ctypes calls are made with their arguments built once, so they differ only in the API below them.
Prints µs per launch in the forward (each round's difference / 18, median [quartiles]) and alone.
"""
import argparse
import ctypes
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import call_prices, write_json  # noqa: E402
from tpprobe.fingerprint.reference import Deferred  # noqa: E402

VARIANTS = ["off", "driver", "runtime", "taker", "later1", "props"]
PER_FORWARD = 18


@triton.jit
def _touch(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _cudart():
    """The CUDA runtime torch loaded (from this process's maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "libcudart.so" in p:
                return ctypes.CDLL(p)
    raise SystemExit("launch_api: no libcudart in this process")


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    a.collectives = True
    model, ids, _, dev, sync = decode_model(a, torch.bfloat16)
    buf = torch.zeros(16, dtype=torch.int32, device=dev)
    ck = _touch[(1,)](buf)
    sync()
    cuda = ctypes.CDLL("libcuda.so.1")
    rt = _cudart()
    drv = cuda.cuLaunchKernel
    drv.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                                               ctypes.c_void_p]
    drv.restype = ctypes.c_int
    lib, kern = ctypes.c_void_p(), ctypes.c_void_p()
    cubin = ck.asm["cubin"]
    load = rt.cudaLibraryLoadData
    load.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    r = load(ctypes.byref(lib), cubin, None, None, 0, None, None, 0)
    if r:
        raise SystemExit(f"cudaLibraryLoadData: {r}")
    get = rt.cudaLibraryGetKernel
    get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    r = get(ctypes.byref(kern), lib, ck.metadata.name.encode())
    if r:
        raise SystemExit(f"cudaLibraryGetKernel: {r}")
    rtl = rt.cudaLaunchKernel
    rtl.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    rtl.restype = ctypes.c_int
    vals = (ctypes.c_uint64 * 4)(buf.data_ptr(), 0, 0, 0)     # the pointer, then Triton's scratch pointers
    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(vals) + 8 * i for i in range(4)])
    threads, shared = 32 * ck.metadata.num_warps, ck.metadata.shared
    one, block = Dim3(1, 1, 1), Dim3(threads, 1, 1)
    state = {"mode": "off"}
    stream = torch.cuda.current_stream(dev).cuda_stream
    fn = ck.function

    def extra(mod, args, out):
        m = state["mode"]
        if m == "driver":
            drv(fn, 1, 1, 1, threads, 1, 1, shared, stream, params, None)
            drv(fn, 1, 1, 1, threads, 1, 1, shared, stream, params, None)
        elif m == "runtime":
            rtl(kern, one, block, params, shared, stream)
            rtl(kern, one, block, params, shared, stream)
        elif m == "taker":
            tk = state["tk"]
            tk(out)
            tk(out)
        elif m == "later1":
            launch_later(item, bases, stream)
            launch_later(item, bases, stream)
        elif m == "props":
            for _ in range(2):
                out.is_cuda, out.shape, out.dtype, out.get_device(), out.data_ptr(), out.is_contiguous()

    rows = [x for layer in model.layers for x in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    for m in [model.embed_tokens] + rows:
        m.register_forward_hook(extra)
    # the fingerprint kernel's entry and the C module, made by a first call through Python
    x = torch.ones(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    warm = Deferred(0x7470, 32)
    warm(x)
    warm.resolve()
    nat = sys.modules["tpprobe.fingerprint.triton.native"].NATIVE
    if nat is None:
        raise SystemExit("launch_api: the C module is not built here (fingerprint/triton/native.py: WHY)")
    launch_later = nat.launch_later
    keep = Deferred(0x7470, 32)
    keep.later(x)
    item = list(keep.batch.later)
    bases = [b.data_ptr() for b, _ in keep.batch.chunks]

    def fresh():
        d = Deferred(0x7470, 32)
        d(x)                                       # starts the batch (the Python path), then C
        state.update(d=d, tk=d.fast())

    for v in ("driver", "runtime"):              # both launch, and the same kernel: +2 each
        before = buf[0].item()
        state["mode"] = v
        extra(None, None, None)
        sync()
        assert buf[0].item() == before + 2, (v, before, buf[0].item())
    state["mode"] = "off"

    def forward():
        with torch.no_grad():
            model(ids)

    res = call_prices(VARIANTS, state, forward, lambda: extra(None, None, x), PER_FORWARD, a.rounds, sync,
                      start=lambda v: fresh(), end=lambda: state["d"].resolve())
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "tokens": a.tokens, **res}
    print(f"launch_api: {out['gpu']}, {a.tokens} token(s), off {res['off_us']:.0f} us; us per launch")
    for row in res["rows"]:
        print(f"{row['call']:<9}{row['in_forward_us']:>8.2f} [{row['q1']:.2f}, {row['q3']:.2f}]  "
              f"alone {row['alone_us']:.2f}")
    write_json(a.out, "launch_api.json", out)


if __name__ == "__main__":
    main()
