"""Fingerprint cost on CPU (the PyTorch reference path) vs clone and sum.

    .venv/bin/python bench/fingerprint_cpu.py [--out DIR]

Median of N wall-clock runs per method, side by side; writes fingerprint_cpu.json."""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.harness import repeat, write_json  # noqa: E402
from tpprobe.fingerprint.reference import fingerprint  # noqa: E402


def med(fn, n):
    return statistics.median(repeat(fn, n)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--n", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": []}
    print(f"{'shape':>16s} {'dtype':>9s} {'sum ms':>8s} {'clone ms':>9s} {'fp ms':>8s} {'fp/sum':>7s} {'fp/clone':>8s} "
          f"{'MB/s':>7s}")
    for shape in [(512, 1024), (2048, 4096)]:
        for dt in (torch.bfloat16, torch.float32):
            t = torch.randn(*shape).to(dt)
            s = med(lambda: t.sum(), a.n)
            c = med(lambda: t.clone(), a.n)
            f = med(lambda: fingerprint(t), a.n)
            mb = t.numel() * t.element_size() / 1e6
            row = dict(shape=list(shape), dtype=str(dt), sum_ms=s, clone_ms=c, fp_ms=f,
                       fp_over_sum=f / s, fp_over_clone=f / c, fp_MBps=mb / f * 1e3)
            res["rows"].append(row)
            print(f"{str(shape):>16s} {str(dt)[6:]:>9s} {s:8.2f} {c:9.2f} {f:8.1f} {f / s:7.0f} {f / c:8.0f} "
                  f"{mb / f * 1e3:7.0f}")
    write_json(a.out, "fingerprint_cpu.json", res)


if __name__ == "__main__":
    main()
