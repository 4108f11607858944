"""Host and device cost of the fingerprint path on one small decode tensor (diagnostic, issue 14).

    python bench/fp_small.py [--rows 1] [--hidden 7168] [--n 7] [--iters 300]

n tensors [rows, hidden] bf16 per "forward": Batch.add each (host us), the kernels' device time
(CUDA events over 200 launches), a clone's host time, and Batch.read split into the one
device-to-host copy with its sync and the host combine; medians in microseconds.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tpprobe.exchange import _triton_fingerprint as tf  # noqa: E402
from tpprobe.exchange.fingerprint import Pending  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--n", type=int, default=7)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    dev = torch.device("cuda")
    xs = [torch.randn(a.rows, a.hidden, device=dev, dtype=torch.bfloat16) for _ in range(a.n)]
    pc = time.perf_counter
    add, read, copy, comb, clone, total = [], [], [], [], [], []
    orig_to_host = tf.Batch._to_host

    def timed_to_host(self, d):
        t0 = pc()
        h = orig_to_host(self, d)
        copy.append(pc() - t0)
        return h
    tf.Batch._to_host = timed_to_host
    for i in range(a.iters + 10):
        torch.cuda.synchronize()
        t0 = pc()
        b = tf.Batch(0x7470, 32)
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
            add.append((t1 - t0) / a.n)
            read.append(t2 - t1)
            clone.append((t3 - t2) / a.n)
            total.append(t2 - t0)
        del cs
    copy = copy[10:]
    comb = [r - c for r, c in zip(read, copy)]
    # device time of the kernels alone: 200 launches between two events
    b = tf.Batch(0x7470, 32)
    for x in xs:
        b.add(x, Pending())
    b.read()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    b = tf.Batch(0x7470, 32)
    torch.cuda.synchronize()
    e0.record()
    for j in range(200):
        b.add(xs[j % a.n], Pending())
    e1.record()
    torch.cuda.synchronize()
    dev_us = e0.elapsed_time(e1) * 1e3 / 200
    b.read()
    m = lambda v: statistics.median(v) * 1e6  # noqa: E731
    print(f"fp small: {torch.cuda.get_device_name(dev)}, {a.n} x [{a.rows}, {a.hidden}] bf16, median of {a.iters}")
    print(f"  add per tensor (host)   {m(add):8.1f} us")
    print(f"  kernel (device, each)   {dev_us:8.1f} us")
    print(f"  clone per tensor (host) {m(clone):8.1f} us")
    print(f"  read: copy + sync       {m(copy):8.1f} us")
    print(f"  read: combine (host)    {m(comb):8.1f} us")
    print(f"  add x{a.n} + read          {m(total):8.1f} us")


if __name__ == "__main__":
    main()
