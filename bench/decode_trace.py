"""Where an eager decode forward's time goes, host and device, per variant (torch.profiler).

    python bench/decode_trace.py [--tokens 1] [--forwards 10] [--collectives] [--out DIR]

The built-in model of tap_phases.py (bf16, hidden 7168, 4 layers, one GPU; --collectives: the 9
all-reduces of a tp-2 model over a world-1 NCCL group). For each variant (off, installed,
fingerprint, as tap_phases defines them) it profiles --forwards forwards, each from a synchronised
start, and prints per forward: the host's wall, the device's busy time (the union of its kernels and
copies), the device's idle time inside the forward, and the host time of the heaviest ops. The
difference that matters for the ratio: a forward whose device idles most of its wall is host-bound,
and every microsecond of host time the probe adds is added to it. Writes decode_trace.json and one
chrome trace per variant (trace_<variant>.json.gz) to --out.
"""
import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import settled  # noqa: E402
from tpprobe.capture import audit  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.fingerprint.reference import Deferred, resolved  # noqa: E402

VARIANTS = ["off", "installed", "fingerprint"]


def busy(intervals):
    """Total length of the union of [start, end) intervals."""
    tot, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            tot += e - s
            end = e
        elif e > end:
            tot += e - end
            end = e
    return tot


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--forwards", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model, ids, keep5, dev, _ = decode_model(a)

    def bare():
        with torch.no_grad():
            model(ids)

    def one(v):
        if v == "off":
            settled(bare, audit.release)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.profiler.record_function(f"forward_{v}"):
            if v == "off":
                model(ids)
            else:
                fp = Deferred(0x7470, 32) if v == "fingerprint" else None
                with Tap(model, keep=keep5 if fp else (lambda n: False), summarize=fp,
                         keep_allreduce_tensors=False, progress=Progress()) as tap:
                    model(ids)
                if fp is not None:
                    fp.resolve()
                    _ = [resolved(s).to_json() for s in tap.summaries.values()]
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        if v == "off":
            settled(bare, audit.sync)
        return t

    for _ in range(5):
        for v in VARIANTS:
            one(v)
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "tokens": a.tokens,
           "collectives": a.collectives, "variants": {}}
    for v in VARIANTS:
        walls = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.forwards):
                walls.append(one(v))
        evs = prof.events()
        fwd = [e for e in evs if e.name == f"forward_{v}" and e.device_type.name == "CPU"]
        rows = []
        starts = sorted(f.time_range.start for f in fwd)
        # the device's own work: kernels and copies (not the annotation record_function mirrors on the device)
        gpu = [(k.time_range.start, k.time_range.end) for k in evs
               if k.device_type.name == "CUDA" and not k.name.startswith("forward_")]
        for f in fwd:
            # this forward's device work: what starts before the next forward does (each one ends synchronised)
            s, e = f.time_range.start, f.time_range.end
            nxt = next((x for x in starts if x > s), float("inf"))
            dev_iv = [(a0, a1) for a0, a1 in gpu if s <= a0 < nxt]
            b = busy(dev_iv)
            first = min((x for x, _ in dev_iv), default=s)
            last = max((y for _, y in dev_iv), default=e)
            rows.append({"host_us": e - s, "device_busy_us": b, "device_ops": len(dev_iv),
                         "device_idle_in_span_us": (last - first) - b, "host_lead_us": first - s})
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
        top = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:30]
        res["variants"][v] = {"wall_us_median": statistics.median(walls) * 1e6, "per_forward_median": med,
                              "top_self_cpu_us_per_forward": [
                                  {"name": k.key, "calls": k.count / a.forwards,
                                   "self_cpu_us": k.self_cpu_time_total / a.forwards} for k in top]}
        path = os.path.join(a.out, f"trace_{v}.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as fi, gzip.open(path + ".gz", "wb") as fo:
            shutil.copyfileobj(fi, fo)
        os.remove(path)
        print(f"{v:<12} wall {res['variants'][v]['wall_us_median']:8.1f} us  " +
              "  ".join(f"{k} {x:8.1f}" for k, x in med.items()))
    with open(os.path.join(a.out, "decode_trace.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
