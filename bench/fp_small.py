"""Host and device cost of the fingerprint path on small decode tensors.

    python bench/fp_small.py [--rows 1] [--hidden 7168] [--n 7] [--iters 300] [--only device|host]

n tensors [rows, hidden] bf16 per "forward": Batch.add each (host us), the kernels' device time
(CUDA events over 200 launches), a clone's host time, and Batch.read split, side by side for the
two combines:
  device (the default): the combine's launch (descriptors up, one kernel; host time), its device
    time (CUDA events), the one small copy back with its sync, the host's formatting;
  host (TPPROBE_FP_HOST_COMBINE=1, as before): the copy of every partial with its sync, and the
    numpy combine.
Medians in microseconds; the fingerprints of both must be equal to the bit (checked).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tpprobe.fingerprint import triton as tf  # noqa: E402
from tpprobe.fingerprint.reference import Pending  # noqa: E402

pc = time.perf_counter


class Timed:
    """Wraps Batch._to_host and Batch._combine_launch to time them (host seconds per call)."""

    def __init__(self):
        self.copy, self.launch = [], []
        self.orig = tf.Batch._to_host, tf.Batch._combine_launch
        to_host, launch = self.orig
        outer = self

        def timed_to_host(self, d):
            t0 = pc()
            h = to_host(self, d)
            outer.copy.append(pc() - t0)
            return h

        def timed_launch(self, items):
            t0 = pc()
            r = launch(self, items)
            outer.launch.append(pc() - t0)
            return r
        tf.Batch._to_host, tf.Batch._combine_launch = timed_to_host, timed_launch

    def restore(self):
        tf.Batch._to_host, tf.Batch._combine_launch = self.orig


def run(xs, iters: int, host_combine: bool) -> dict:
    tm = Timed()
    add, read, clone, total = [], [], [], []
    for i in range(iters + 10):
        torch.cuda.synchronize()
        t0 = pc()
        b = tf.Batch(0x7470, 32, host_combine=host_combine)
        ps = []
        for x in xs:
            p = Pending()
            b.add(x, p)
            ps.append(p)
        t1 = pc()
        b.read()
        t2 = pc()
        cs = [x.clone() for x in xs]
        t3 = pc()
        if i >= 10:
            add.append((t1 - t0) / len(xs))
            read.append(t2 - t1)
            clone.append((t3 - t2) / len(xs))
            total.append(t2 - t0)
        del cs
    tm.restore()
    assert not tf.STATE.combine_why, tf.STATE.combine_why
    copy = tm.copy[10:]
    launch = tm.launch[10:] if not host_combine else [0.0] * len(copy)
    rest = [r - c - la for r, c, la in zip(read, copy, launch)]
    m = lambda v: statistics.median(v) * 1e6  # noqa: E731
    out = {"add": m(add), "clone": m(clone), "copy_sync": m(copy), "total": m(total),
           "fps": [json.dumps(p.fp.to_json()) for p in ps]}
    if host_combine:
        out["combine_host"] = m(rest)
    else:
        out["combine_launch"], out["format"] = m(launch), m(rest)
    return out


def device_times(xs) -> dict:
    """The fused kernels' and the combine's device time (CUDA events)."""
    b = tf.Batch(0x7470, 32)
    for x in xs:
        b.add(x, Pending())
    b.read()
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    b = tf.Batch(0x7470, 32)
    torch.cuda.synchronize()
    e0.record()
    for j in range(200):
        b.add(xs[j % len(xs)], Pending())
    e1.record()
    torch.cuda.synchronize()
    kern = e0.elapsed_time(e1) * 1e3 / 200
    b.read()
    b = tf.Batch(0x7470, 32)
    for x in xs:
        b.add(x, Pending())
    torch.cuda.synchronize()
    e1.record()
    for _ in range(50):
        b._combine_launch(b.items)
    e2.record()
    torch.cuda.synchronize()
    b.read()
    return {"kernel": kern, "combine": e1.elapsed_time(e2) * 1e3 / 50}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--only", choices=["device", "host"], default=None,
                    help="time one combine only (default: both, side by side)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    xs = [torch.randn(a.rows, a.hidden, device=dev, dtype=torch.bfloat16) for _ in range(a.n)]
    modes = [m for m in ("device", "host") if a.only in (None, m)]
    res = {m: run(xs, a.iters, m == "host") for m in modes}
    dt = device_times(xs)
    print(f"fp small: {torch.cuda.get_device_name(dev)}, {a.n} x [{a.rows}, {a.hidden}] bf16, median of {a.iters}")
    print(f"  kernel (device, each)        {dt['kernel']:8.1f} us")
    print(f"  combine kernel (device, all) {dt['combine']:8.1f} us  (descriptor copy + one launch)")
    for m in modes:
        r = res[m]
        print(f"  [{m} combine]")
        print(f"    add per tensor (host)      {r['add']:8.1f} us")
        print(f"    clone per tensor (host)    {r['clone']:8.1f} us")
        if m == "device":
            print(f"    read: combine launch (host){r['combine_launch']:8.1f} us")
            print(f"    read: copy + sync          {r['copy_sync']:8.1f} us")
            print(f"    read: format (host)        {r['format']:8.1f} us")
        else:
            print(f"    read: copy + sync          {r['copy_sync']:8.1f} us")
            print(f"    read: combine (host)       {r['combine_host']:8.1f} us")
        print(f"    add x{a.n} + read             {r['total']:8.1f} us")
    if len(modes) == 2:
        same = res["device"]["fps"] == res["host"]["fps"]
        print(f"  device == host fingerprints, to the bit: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
