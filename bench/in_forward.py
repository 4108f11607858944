"""What one host call costs between the model's own ops, against the same call in a warm loop.

    python bench/in_forward.py [--tokens 1] [--rounds 60] [--collectives] [--out DIR]

The bare decode forward of the built-in model (bench/decode_setup.py; with --collectives the 9
all-reduces of a tp-2 model over a world-1 NCCL group), no Tap. A forward hook on each of the 9
all-reducing modules (after their all-reduce) does, per variant, two of one kind of call and nothing
else, so a variant's time over `off` divided by 18 is what that call costs inside a forward:
  off        the hook returns at once (every variant pays this call)
  pycall     two calls of an empty Python function
  launch_c   two fingerprint launches from the C Taker (fingerprint/triton/native.c)
  launch_py  two fingerprint launches through Deferred (Python)
  launch_tiny two fingerprint launches from the C Taker of a [1, 1024] tensor (less device time)
  sleep      two of torch's spin kernels (torch.cuda._sleep) of about a fingerprint's device time
  event      two CUDA events created and recorded (torch.cuda.Event)
  event_base two of torch's base CUDA events created and recorded on the kept Stream (as the door does)
  event_pool two CUDA events made before the forward, recorded again on the kept Stream
  copy       two copies of the output into a buffer made before the forward (aten copy_)
  memcpy     two cuMemcpyDtoDAsync of it into that buffer, called through ctypes
  clone      two clones of the reduced output
  add        two sums of it with itself (the kind of op hidden + residual is)
  allreduce  two more world-1 all-reduces of it (ProcessGroup.allreduce: what NCCL's call costs)
Variants alternate round by round; each forward is timed from a synchronised start to the device
done; a launch variant's fingerprints are read after the timing. Then each call alone, 18 in a row
in a warm loop, the same way. Prints µs per call in the forward and alone; writes in_forward.json.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import call_prices, write_json  # noqa: E402
from tpprobe.core.cuda import current_stream  # noqa: E402
from tpprobe.fingerprint.reference import Deferred  # noqa: E402

VARIANTS = ["off", "pycall", "launch_c", "launch_py", "launch_tiny", "sleep", "event", "event_base", "event_pool",
            "clone", "add", "copy", "memcpy", "allreduce"]
PER_FORWARD = 18
SLEEP_CYCLES = 12000        # about 6.5 us at the H100's 1.98 GHz: a decode fingerprint's device time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    a.collectives = True
    os.environ["TPPROBE_NATIVE"] = "1"
    model, ids, _, dev, sync = decode_model(a, torch.bfloat16)
    state = {"mode": "off", "fp": None, "tk": None}

    def nothing():
        return None

    def extra(mod, args, out):
        m = state["mode"]
        if m == "off" or (m.startswith(("event", "memcpy", "sleep")) and not out.is_cuda):
            return
        if m == "pycall":
            nothing()
            nothing()
        elif m in ("launch_c", "launch_py"):
            tk = state["tk"]
            tk(out)
            tk(out)
        elif m == "launch_tiny":
            tk, tiny = state["tk"], state["tiny"]
            tk(tiny)
            tk(tiny)
        elif m == "sleep":
            torch.cuda._sleep(SLEEP_CYCLES)
            torch.cuda._sleep(SLEEP_CYCLES)
        elif m == "event":
            torch.cuda.Event().record()
            torch.cuda.Event().record()
        elif m == "event_base":
            s = current_stream(out.device.index)
            record(Event(), s)
            record(Event(), s)
        elif m == "event_pool":
            s, pool = current_stream(out.device.index), state["pool"]
            record(pool.pop(), s)
            record(pool.pop(), s)
        elif m == "copy":
            ring = state["ring"]
            ring[0].copy_(out)
            ring[1].copy_(out)
        elif m == "memcpy":
            dst, n = state["ring_ptr"], out.numel() * out.element_size()
            stream = current_stream(out.device.index).cuda_stream
            memcpy(dst, out.data_ptr(), n, stream)
            memcpy(dst + n, out.data_ptr(), n, stream)
        elif m == "clone":
            out.clone()
            out.clone()
        elif m == "add":
            out + out
            out + out
        elif m == "allreduce":
            dist.all_reduce(out)
            dist.all_reduce(out)

    mods = [model.embed_tokens] + [x for layer in model.layers for x in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    for m in mods:
        m.register_forward_hook(extra)

    Event = torch._C._CudaEventBase if dev.type == "cuda" else None
    record = getattr(Event, "record", None)
    if dev.type == "cuda":
        import ctypes
        memcpy = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
        memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    ring = torch.empty(2, a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    state.update(ring=ring, ring_ptr=ring.data_ptr(), tiny=torch.ones(1, 1024, device=dev, dtype=torch.bfloat16))

    def fresh(v):
        if Event is not None:
            state["pool"] = [Event() for _ in range(PER_FORWARD)]
            for e in state["pool"]:        # torch makes the driver's event at its first record
                record(e, current_stream(dev.index))
        fp = Deferred(0x7470, 32)
        state["fp"] = fp
        state["tk"] = fp.fast() if v in ("launch_c", "launch_tiny") else fp
        if v == "launch_tiny":                  # its entry made on the Python path, then C
            state["tk"](state["tiny"])

    # the module is built at the first GPU batch: one Deferred call through Python first
    warm = Deferred(0x7470, 32)
    warm(torch.ones(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16))
    warm.resolve()

    def forward():
        with torch.no_grad():
            model(ids)

    x = torch.ones(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    res = call_prices(VARIANTS, state, forward, lambda: extra(None, None, x), PER_FORWARD, a.rounds, sync,
                      start=fresh, end=lambda: state["fp"].resolve())
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = {"gpu": gpu, "torch": torch.__version__, "tokens": a.tokens, **res}
    print(f"in_forward: {out['gpu']}, torch {out['torch']}, {a.tokens} token(s), off {res['off_us']:.0f} us; "
          f"{PER_FORWARD} calls a forward, us per call (round by round: median of each round's difference / 18)")
    print(f"{'call':<11}{'in forward':>12}{'[q1, q3]':>20}{'alone':>9}{'x alone':>9}")
    for row in res["rows"]:
        q1, q2, q3 = row["q1"], row["in_forward_us"], row["q3"]
        print(f"{row['call']:<11}{q2:>12.2f}{f'[{q1:.2f}, {q3:.2f}]':>20}{row['alone_us']:>9.2f}"
              f"{q2 / row['alone_us']:>9.2f}")
    write_json(a.out, "in_forward.json", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
