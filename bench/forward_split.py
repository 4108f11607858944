"""Which of the probe's own functions the host time of a checked decode forward goes to.

    python bench/forward_split.py [--tokens 1] [--forwards 200] [--collectives] [--out DIR]

The model and the fingerprint variant of tap_phases.py (`--exchange fingerprint`: the 3 EAGLE-3
slots, embed.* and in_norm kept, every other point and every audited collective's input and output
fingerprinted, read with one copy after the forward). Each function named in SPLIT is wrapped by an
inclusive timer (perf_counter, a few hundred nanoseconds a call of its own), so the table says, per
forward, how often each one ran and how long it took with everything it called: nested ones are
inside their callers' numbers; each number is the median over the forwards of that function's time in
one forward. The bare forward (`off`) and the unwrapped checked one are timed first,
alternated, for the totals the split is a part of. Writes forward_split.json to --out.
With ProcessGroup.allreduce under a timer, the collectives take the Python door (the C door,
fingerprint/triton/native.c, is not put in place over a wrapper): the split is the Python paths'.
"""
import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import alternate, medians, paired, settled  # noqa: E402
from tpprobe.capture import audit  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.fingerprint.reference import Deferred, resolved  # noqa: E402

# (module path, attribute path): the functions timed, outermost first
SPLIT = [
    ("torch.distributed", "ProcessGroup.allreduce"),
    ("tpprobe.capture.hooks.tap", "Tap.__init__"),
    ("tpprobe.capture.hooks.tap", "Tap.__enter__"),
    ("tpprobe.capture.hooks.plan", "PlanCache.plan"),
    ("tpprobe.capture.hooks.tap", "Tap._remove"),
    ("tpprobe.capture.hooks.tap", "Tap._layer_post"),
    ("tpprobe.capture.hooks.tap", "Tap._row_post"),
    ("tpprobe.capture.hooks.tap", "Tap._in_norm_post"),
    ("tpprobe.capture.hooks.tap", "Tap._embed_post"),
    ("tpprobe.capture.hooks.tap", "Tap._record"),
    ("tpprobe.capture.hooks.outputs", "residual_stream"),
    ("tpprobe.capture.audit.recorder", "Audit.begin"),
    ("tpprobe.capture.audit.recorder", "Audit.end"),
    ("tpprobe.capture.hooks.collectives", "Collectives._attribution"),
    ("tpprobe.capture.hooks.collectives", "Collectives._after_collective"),
    ("tpprobe.fingerprint.reference", "Deferred.__call__"),
    ("tpprobe.fingerprint.triton.batch", "Batch.add"),
    ("tpprobe.fingerprint.reference", "Deferred.resolve"),
    ("tpprobe.fingerprint.triton.batch", "Batch._combine_launch"),
    ("tpprobe.fingerprint.triton.batch", "Batch._to_host"),
    ("tpprobe.fingerprint.triton.batch", "Batch._format"),
    # finer: what the door, the Tap's enter and exit and the records are made of
    ("tpprobe.capture.audit.doors", "_door_allreduce"),
    ("tpprobe.capture.audit.c10d", "sub_ranks"),
    ("tpprobe.capture.audit.records", "CollectiveRecord.__init__"),
    ("tpprobe.capture.audit.records", "dtype_name"),
    ("tpprobe.fingerprint.triton.batch", "Batch.take"),
    ("tpprobe.fingerprint.triton.batch", "Item.__init__"),
    ("tpprobe.capture.progress", "Progress.set"),
    ("tpprobe.capture.hooks.tap", "Tap._install"),
    ("tpprobe.capture.hooks.tap", "Tap._hook"),
    ("tpprobe.capture.hooks.plan", "Registrations.acquire"),
    ("tpprobe.capture.hooks.plan", "Registrations.release"),
    ("tpprobe.capture.audit.recorder", "Audit.__enter__"),
    ("tpprobe.capture.audit.recorder", "Audit.__exit__"),
    ("tpprobe.capture.hooks.install", "HookHandle.remove"),
    ("tpprobe.capture.hooks.tap", "Tap._embed_found"),
    ("tpprobe.capture.hooks.tap", "Tap.add_row_output"),
]
# in the bare forward (the audit released): what the collective itself costs there
OFF_SPLIT = [("torch.distributed", "ProcessGroup.allreduce"), ("torch.distributed.distributed_c10d", "all_reduce")]


def wrap_all(acc, split=SPLIT):
    import importlib
    undo = []
    for mod, path in split:
        m = importlib.import_module(mod)
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(m, owner_name) if owner_name else m
        raw = owner.__dict__[attr] if owner_name else getattr(m, attr)
        slot = acc[path]
        pc = time.perf_counter

        def timed(*a, _raw=raw, _slot=slot, **k):
            t0 = pc()
            try:
                return _raw(*a, **k)
            finally:
                _slot[0] += pc() - t0
                _slot[1] += 1
        setattr(owner, attr, timed)
        undo.append((owner, attr, raw))
        if not owner_name:      # a function imported by name elsewhere: patch those names too
            for other in list(sys.modules.values()):
                if other is not m and getattr(other, attr, None) is raw:
                    setattr(other, attr, timed)
                    undo.append((other, attr, raw))
    return undo


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model, ids, keep5, dev, sync = decode_model(a)
    cuda = dev.type == "cuda"

    def bare():
        with torch.no_grad():
            model(ids)

    def one(v):
        if v == "off":
            settled(bare, audit.release)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            if v == "off":
                model(ids)
            else:
                fp = Deferred(0x7470, 32)
                with Tap(model, keep=keep5, summarize=fp, keep_allreduce_tensors=False, progress=Progress()) as tap:
                    model(ids)
                fp.resolve()
                _ = [resolved(s).to_json() for s in tap.summaries.values()]
        sync()
        t = time.perf_counter() - t0
        if v == "off":
            settled(bare, audit.sync)
        return t

    times = alternate(["off", "fingerprint"], one, 60, warmup=3)
    med, pair = medians(times), paired(times)["fingerprint"]
    acc = defaultdict(lambda: [0.0, 0])
    undo = wrap_all(acc)
    one("fingerprint")
    for slot in acc.values():      # the timers hold their slots: zeroed, never replaced
        slot[0], slot[1] = 0.0, 0
    wrapped, per = [], []          # per forward: each function's (seconds, calls) in it
    for _ in range(a.forwards):
        before = {k: tuple(v) for k, v in acc.items()}
        wrapped.append(one("fingerprint"))
        per.append({k: (acc[k][0] - before[k][0], acc[k][1] - before[k][1]) for k in acc})
    for owner, attr, raw in undo:
        setattr(owner, attr, raw)
    off_acc = defaultdict(lambda: [0.0, 0])
    off_per = []
    for _ in range(a.forwards // 4):
        settled(bare, audit.release)
        undo = wrap_all(off_acc, OFF_SPLIT)
        before = {k: tuple(v) for k, v in off_acc.items()}
        sync()
        with torch.no_grad():
            model(ids)
        sync()
        off_per.append({k: (off_acc[k][0] - before[k][0], off_acc[k][1] - before[k][1]) for k in off_acc})
        for owner, attr, raw in undo:
            setattr(owner, attr, raw)
        settled(bare, audit.sync)
    # the median forward, function by function (a one-off, a collection or a compile, is not spread over all)
    rows = [{"function": p, "calls": statistics.median(f[p][1] for f in per),
             "us": statistics.median(f[p][0] for f in per) * 1e6} for _, p in SPLIT if acc[p][1]]
    rows += [{"function": "off: " + p, "calls": statistics.median(f[p][1] for f in off_per),
              "us": statistics.median(f[p][0] for f in off_per) * 1e6} for _, p in OFF_SPLIT if off_acc[p][1]]
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"forward split: {name}, torch {torch.__version__}, {a.tokens} token(s), "
          f"{'9 all-reduces, ' if a.collectives else ''}off {med['off'] * 1e6:.0f} us, "
          f"fingerprint {med['fingerprint'] * 1e6:.0f} us ({med['fingerprint'] / med['off']:.3f}x; round by round "
          f"{pair[1]:.3f}x [{pair[0]:.3f}, {pair[2]:.3f}]), "
          f"with the timers {statistics.median(wrapped) * 1e6:.0f} us; per forward, inclusive:")
    for r in rows:
        print(f"  {r['function']:<36} {r['calls']:6.1f} calls {r['us']:9.1f} us")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "forward_split.json"), "w") as f:
        json.dump({"bench": "forward_split", "device": name, "tokens": a.tokens, "collectives": a.collectives,
                   "off_us": med["off"] * 1e6, "fingerprint_us": med["fingerprint"] * 1e6, "paired_x": pair,
                   "wrapped_us": statistics.median(wrapped) * 1e6, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
