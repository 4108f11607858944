"""Host microseconds of the pieces a checked eager decode forward is made of, on one GPU.

    python bench/host_pieces.py [--n 300]

One process, a world-1 NCCL group, a [1, 7168] bf16 tensor; each line is the median of --n calls
on the host clock: a group's ranks (`sub_ranks`), a CUDA event created and recorded (the Tap's
completion event per collective), a bare `all_reduce` with the audit released, the same with the
audit's kernels registered and ProcessGroup's doors open (between checked forwards), the same
through the audit's kernel (doors closed), `work.wait()`, a clone, one queued fused fingerprint
(`Deferred` add), the read of 24 of them split into its parts (combine launch, one D2H copy and
sync, formatting), and an idle `torch.cuda.synchronize()`. docs/benchmarks.md reads the Tap's
phases (bench/tap_phases.py) with these.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from tpprobe.capture import audit
    from tpprobe.capture.audit.c10d import sub_ranks
    from tpprobe.capture.hooks.collectives import _Event, _record
    from tpprobe.core.cuda import current_stream
    from tpprobe.fingerprint.reference import Deferred
    pc = time.perf_counter

    def med(fn, n=a.n):
        for _ in range(10):
            fn()
        ts = []
        for _ in range(n):
            t = pc()
            fn()
            ts.append(pc() - t)
        return statistics.median(ts) * 1e6

    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    pg = dist.group.WORLD
    rows = {"sub_ranks": med(lambda: sub_ranks(pg, 1))}

    def event():
        _record(_Event(), current_stream(0))
    rows["event create + record"] = med(event)
    audit.release()
    rows["all_reduce, audit released"] = med(lambda: dist.all_reduce(x))
    audit.sync()
    rows["all_reduce, kernels + doors (idle)"] = med(lambda: dist.all_reduce(x))
    audit.set_doors(False)
    rows["all_reduce, through the kernel"] = med(lambda: dist.all_reduce(x))
    audit.set_doors(True)
    w = dist.all_reduce(x, async_op=True)
    rows["work.wait()"] = med(w.wait)
    rows["clone"] = med(x.clone)
    rows["empty_like"] = med(lambda: torch.empty_like(x))
    d = Deferred(0x7470, 32)
    for _ in range(3):
        d(x)
        d.resolve()

    def adds():
        for _ in range(24):
            d(x)
    rows["Deferred add (of 24)"] = med(adds, n=a.n // 3) / 24
    d.resolve()
    b = d.batch
    parts = []
    for _ in range(a.n // 3):
        for _ in range(24):
            d(x)
        torch.cuda.synchronize()
        t0 = pc()
        items = b.items
        res = b._combine_launch(items)
        t1 = pc()
        host = b._to_host(res)
        t2 = pc()
        b._format(items, host)
        t3 = pc()
        b._give_back()
        b.items = []
        parts.append((t1 - t0, t2 - t1, t3 - t2))
    for i, name in enumerate(("read 24: combine launch", "read 24: D2H copy + sync", "read 24: format")):
        rows[name] = statistics.median(p[i] for p in parts) * 1e6
    rows["synchronize, idle device"] = med(torch.cuda.synchronize)
    print(f"host µs, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, median of {a.n}")
    for k, v in rows.items():
        print(f"{k:<40} {v:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
