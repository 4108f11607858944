"""Host cost of a fingerprint launch: the path it replaced vs today's, side by side in one run
(issue 14, point 3: fingerprint mode <= 1.3x of probe off in eager decode, where the kernel is
microseconds and the host's Python per launch was about half a millisecond).

    python bench/fingerprint_host.py [--rows 1,8,64] [--hidden 7168] [--per-forward 30] [--rounds 30] [--out DIR]
    TRITON_INTERPRET=1 python bench/fingerprint_host.py --rows 1,3 --hidden 256 --per-forward 4 --rounds 2
        (no GPU: Triton's CPU interpreter runs the kernels; the machinery and the equality only,
        its times mean nothing)
    python bench/fingerprint_host.py --stub-kernels
        (no GPU: CPU tensors, each kernel launch a no-op and the partials zero: the host's Python
        around the launch alone, both paths; no equality, the fingerprints mean nothing)

One "forward" = --per-forward [rows, hidden] bf16 tensors fingerprinted as the probe does
(`Deferred`: one call per tensor, queued on the stream), then `resolve()` (the one device-to-host
copy and the combine).  Per round both paths run on the same tensors, in alternating order, from
a drained device; medians over --rounds after 3 warm-up rounds (compiles, caches):
  old   bench/_fp_old_launch.py, the host path as it was (commit 8b49ec6): per tensor the dispatch
        checks and the TPPROBE_FP_* knobs read again, a plan, a fresh partial buffer and its views,
        JITFunction.run, then one combine per tensor
  new   tpprobe.exchange.fingerprint.Deferred: a `_triton_fingerprint.Batch` (per-shape cached
        plan and arguments, one partials buffer per forward, the CompiledKernel launched directly
        after a shape's first launch, one vectorised combine per shape)
Columns: host us per launch (the calls), resolve ms per forward, total ms per forward, and from
one counted round each: aten ops and Python function calls per launch (a TorchDispatchMode
counter; cProfile).  `equal`: every fingerprint of the new path equals the old one's, bit for
bit (to_json).  Writes fingerprint_host.json to --out.
"""
import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
INTERP = bool(os.environ.get("TRITON_INTERPRET"))
if INTERP:
    from bench import _interp_shim  # noqa: E402

    _interp_shim.install()
import numpy as np  # noqa: E402
import triton  # noqa: E402

from bench import _fp_old_launch as old  # noqa: E402
import tpprobe.exchange._triton_fingerprint as tf  # noqa: E402
from tpprobe.exchange import fingerprint as FP  # noqa: E402

SEED, K = 0x7470, 32        # the probe's


class InterpDeferred(FP.Deferred):
    """The CPU interpreter's stand-in: CPU tensors take the fused path too."""

    def __call__(self, t):
        b = self.batch if self.batch is not None else self._start()
        ph = FP.Pending()
        assert b.add(t, ph)
        return ph


class StubDeferred(InterpDeferred):
    """--stub-kernels: the fused path on CPU tensors with every kernel launch a no-op."""

    def _start(self):
        b = super()._start()
        b.stream = lambda dev: 0
        return b


class _StubCompiled:
    function = packed_metadata = None

    def run(self, *args):
        pass


class _StubKernel:
    """A JITFunction whose launch does nothing and returns a CompiledKernel-like launcher."""

    def __init__(self, kern):
        self.kern = kern

    def __getattr__(self, name):
        return getattr(self.kern, name)

    def __getitem__(self, grid):
        return lambda *args, **kw: _StubCompiled()


def stub_kernels():
    for mod in (tf, old):
        mod._fp16_kernel, mod._fp32_kernel = _StubKernel(tf._fp16_kernel), _StubKernel(tf._fp32_kernel)
    old._triton_ok = lambda t: True
    plain = old.buffers

    def zeroed(ioff, foff, ntok, device):      # as the new path's buffer: finite partials
        bufs = plain(ioff, foff, ntok, device)
        bufs[0].zero_()
        return bufs

    old.buffers = zeroed


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def one_forward(make, ts, dev):
    """(seconds in the launches, seconds in resolve, the fingerprints) of one forward."""
    sync(dev)
    t0 = time.perf_counter()
    d = make()
    out = [d(t) for t in ts]
    t1 = time.perf_counter()
    d.resolve()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, [getattr(x, "fp", x) for x in out]     # either path's Pending


def counted(make, ts, dev):
    """(aten ops per launch, Python calls per launch, aten ops in resolve) of one forward."""
    sync(dev)
    d = make()
    with CountOps() as c:
        out = [d(t) for t in ts]
    with CountOps() as r:
        d.resolve()
    d = make()
    pr = cProfile.Profile()
    pr.enable()
    out = [d(t) for t in ts]
    pr.disable()
    d.resolve()
    del out
    return c.n / len(ts), pstats.Stats(pr).total_calls / len(ts), r.n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64", help="token rows of each tensor, comma-separated")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--per-forward", type=int, default=30, help="tensors fingerprinted per forward")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--stub-kernels", action="store_true", help="CPU: every launch a no-op (host Python only)")
    a = ap.parse_args()
    if a.stub_kernels:
        if INTERP:
            sys.exit("fingerprint_host: --stub-kernels runs without TRITON_INTERPRET")
        dev = torch.device("cpu")
        stub_kernels()
        new_make = lambda: StubDeferred(SEED, K)    # noqa: E731
    elif INTERP:
        dev = torch.device("cpu")
        old._triton_ok = lambda t: True           # the frozen path's dispatch wanted CUDA tensors
        new_make = lambda: InterpDeferred(SEED, K)  # noqa: E731
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
        new_make = lambda: FP.Deferred(SEED, K)     # noqa: E731
    else:
        sys.exit("fingerprint_host: needs a CUDA GPU; on a CPU: TRITON_INTERPRET=1 (the machinery and the "
                 "equality) or --stub-kernels (the host Python alone)")
    old_make = lambda: old.Deferred(SEED, K)        # noqa: E731
    dtype = getattr(torch, a.dtype)
    where = "cpu, kernel launches stubbed" if a.stub_kernels else "cpu (Triton interpreter)"
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else where,
           "torch": torch.__version__, "triton": triton.__version__, "numpy": np.__version__,
           "hidden": a.hidden, "dtype": a.dtype, "per_forward": a.per_forward, "rounds": a.rounds, "rows": []}
    print(f"{'rows':>5} {'old us/launch':>14} {'new us/launch':>14} {'x':>6} {'old resolve ms':>15} "
          f"{'new resolve ms':>15} {'old ms/fwd':>11} {'new ms/fwd':>11} {'x':>6} {'aten/launch':>12} "
          f"{'py calls/launch':>16} {'equal':>6}")
    for rows in [int(x) for x in a.rows.split(",") if x]:
        g = torch.Generator(device=dev).manual_seed(rows)
        ts = [torch.randn(rows, a.hidden, generator=g, device=dev).to(dtype) for _ in range(a.per_forward)]
        paths = {"old": old_make, "new": new_make}
        for _ in range(3):                        # warm-up: compiles, the entries, pinned memory
            for make in paths.values():
                one_forward(make, ts, dev)
        times = {p: {"launch": [], "resolve": []} for p in paths}
        fps = {}
        for i in range(a.rounds):
            for p in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
                tl_, tr, fps[p] = one_forward(paths[p], ts, dev)
                times[p]["launch"].append(tl_ / a.per_forward * 1e6)
                times[p]["resolve"].append(tr * 1e3)
        equal = None if a.stub_kernels else \
            [json.dumps(x.to_json()) for x in fps["old"]] == [json.dumps(x.to_json()) for x in fps["new"]]
        counts = {p: counted(paths[p], ts, dev) for p in paths}
        med = {p: {k: statistics.median(v) for k, v in times[p].items()} for p in paths}
        tot = {p: med[p]["launch"] * a.per_forward / 1e3 + med[p]["resolve"] for p in paths}
        direct = any(e.ck is not None for ents in tf._ENTRIES.values() for e in ents.values())
        row = {"rows": rows, "shape": [rows, a.hidden], "equal": equal, "direct_launch": direct,
               **{f"{p}_launch_us": med[p]["launch"] for p in paths},
               **{f"{p}_resolve_ms": med[p]["resolve"] for p in paths},
               **{f"{p}_forward_ms": tot[p] for p in paths},
               "launch_x": med["old"]["launch"] / med["new"]["launch"], "forward_x": tot["old"] / tot["new"],
               **{f"{p}_aten_per_launch": counts[p][0] for p in paths},
               **{f"{p}_pycalls_per_launch": counts[p][1] for p in paths},
               **{f"{p}_aten_in_resolve": counts[p][2] for p in paths},
               "all": times}
        res["rows"].append(row)
        print(f"{rows:5d} {med['old']['launch']:14.1f} {med['new']['launch']:14.1f} {row['launch_x']:6.1f} "
              f"{med['old']['resolve']:15.3f} {med['new']['resolve']:15.3f} {tot['old']:11.3f} {tot['new']:11.3f} "
              f"{row['forward_x']:6.1f} {counts['old'][0]:5.1f}->{counts['new'][0]:<5.1f} "
              f"{counts['old'][1]:7.0f}->{counts['new'][1]:<7.0f} {str(equal):>6}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fingerprint_host.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    if not a.stub_kernels and not all(r["equal"] for r in res["rows"]):
        sys.exit("fingerprint_host: the new path's fingerprints differ from the old path's")


if __name__ == "__main__":
    main()
