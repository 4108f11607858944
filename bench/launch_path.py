"""Host us per fingerprint launch: the C Taker (`native`: fingerprint/triton/native.py, the whole
queued launch in C), Triton 3.6's C launch called directly from Python (`launch_of`) and Triton's
launcher object (`launcher`), side by side in one run.

    python bench/launch_path.py [--rows 1] [--hidden 7168] [--per-forward 25] [--rounds 200]

One "forward" = --per-forward [rows, hidden] bf16 tensors fingerprinted as the probe does
(`Deferred`), then `resolve()`. Variants alternate round by round, each with its own cached
entries (so each launches its own way after the first), from a drained device; median host us
per launch (the calls only) and per resolve. `equal`: the two variants' fingerprints agree bit for
bit. With a Triton outside config/knobs.py FAST_PATHS["launch"] no variant launches directly (and
`native` is the Python path).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton  # noqa: E402

from tpprobe.fingerprint.triton import STATE, fastlaunch  # noqa: E402
from tpprobe.fingerprint.reference import Deferred, resolved  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--per-forward", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    os.environ["TPPROBE_NATIVE"] = "1"          # the C module built, to be timed against the Python paths
    dev = torch.device("cuda", 0)
    ts = [torch.randn(a.rows, a.hidden, device=dev).to(torch.bfloat16) for _ in range(a.per_forward)]
    real = fastlaunch.launch_of
    launcher = lambda ck: (ck.run, (ck.packed_metadata, None, None, None))  # noqa: E731
    entries = {"native": {}, "launch_of": {}, "launcher": {}}
    taken = [0]

    def forward(v):
        fastlaunch.launch_of = launcher if v == "launcher" else real
        saved = dict(STATE.entries)
        STATE.entries.clear()
        STATE.entries.update(entries[v])
        try:
            d = Deferred(0x7470, 32)
            f = d.fast() if v == "native" else d
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = [f(t) for t in ts]
            t1 = time.perf_counter()
            d.resolve()
            t2 = time.perf_counter()
            entries[v].update(STATE.entries)
            if f is not d:
                taken[0] += f.taken
        finally:
            STATE.entries.clear()
            STATE.entries.update(saved)
            fastlaunch.launch_of = real
        return (t1 - t0) / len(ts) * 1e6, (t2 - t1) * 1e6, [resolved(x).to_json() for x in out]

    for _ in range(3):
        for v in entries:
            forward(v)
    got = {v: ([], []) for v in entries}
    fps = {}
    for i in range(a.rounds):
        for v in (list(entries) if i % 2 == 0 else list(entries)[::-1]):
            launch, resolve, fps[v] = forward(v)
            got[v][0].append(launch)
            got[v][1].append(resolve)
    e = next(iter(next(iter(entries["launch_of"].values())).values()))     # the shape's entry
    direct = e.direct is not None and e.direct.launch is not getattr(e.direct.compiled, "run", None)
    print(f"launch path: {torch.cuda.get_device_name(dev)}, triton {triton.__version__}, [{a.rows}, {a.hidden}] "
          f"bf16 x {a.per_forward} per forward, {a.rounds} rounds; launch_of takes the C launch: {direct}; "
          f"launches from the C Taker: {taken[0]}")
    for v, (launch, resolve) in got.items():
        print(f"{v:10s} launch {statistics.median(launch):6.2f} us each, resolve {statistics.median(resolve):7.1f} us")
    print(f"equal: {fps['launch_of'] == fps['launcher'] == fps['native']}")


if __name__ == "__main__":
    main()
