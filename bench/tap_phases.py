"""Where the probe's host time goes in one eager decode forward, phase by phase.

    python bench/tap_phases.py [--device cuda|cpu] [--hidden 7168] [--num-layers 4] [--tokens 1]
        [--dtype bfloat16] [--rounds 60] [--out DIR]

One process, world 1 (a gloo group: the built-in model issues no all-reduce at tp 1, so this is the
Tap's own cost; with --collectives a NCCL group on CUDA, and the 9 all-reduces a tp-2 model issues).
Variants, alternated round by round (drift hits all alike), median of --rounds:
  off          the bare forward
  installed    Tap: hooks and the collective audit, keeping nothing
  keep5        + copies of what `--exchange fingerprint` keeps (the 3 EAGLE-3 slots, embed.*, in_norm)
  fp_only      Tap + every point fingerprinted (Deferred: queued, one copy after the forward), no copies
  fingerprint  keep5 + fp_only: what `--exchange fingerprint` does
  fp_no_coll   fingerprint with the collectives' inputs and outputs not fingerprinted (what those cost)
Each is split into phases on the host clock: enter (Tap construction and install), forward (the
model call with the hooks), exit (removal), resolve (the one device-to-host copy and the combine),
json (every summary's to_json), and total (from a synchronised start to the device done). The
differences between variants say what each part of the probe costs.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import alternate, settled  # noqa: E402
from tpprobe.capture import audit  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.fingerprint.reference import Deferred, resolved  # noqa: E402

VARIANTS = ["off", "installed", "keep5", "fp_only", "fingerprint", "fp_no_coll"]
PHASES = ["enter", "forward", "exit", "resolve", "json", "total"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_model_args(ap)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--profile", default="", help="then cProfile 30 forwards of this variant")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    model, ids, keep5, dev, sync = decode_model(a, getattr(torch, a.dtype))
    cuda = dev.type == "cuda"
    pc = time.perf_counter

    def bare():
        with torch.no_grad():
            model(ids)

    def one(v):
        ph = dict.fromkeys(PHASES, 0.0)
        if v == "off":
            settled(bare, audit.release)     # probe off: no kernel or door of the audit on the way
        sync()
        t0 = pc()
        with torch.no_grad():
            if v == "off":
                model(ids)
                t1 = pc()
                ph["forward"] = t1 - t0
                sync()
                ph["total"] = pc() - t0
                settled(bare, audit.sync)      # registered again outside the timing
                return ph
            else:
                fp = Deferred(0x7470, 32) if v in ("fp_only", "fingerprint", "fp_no_coll") else None
                tap = Tap(model, keep=keep5 if v in ("keep5", "fingerprint", "fp_no_coll") else (lambda n: False),
                          summarize=fp, keep_allreduce_tensors=False, progress=Progress())
                if v == "fp_no_coll":
                    tap.auditor.summarize = None
                tap.__enter__()
                t1 = pc()
                model(ids)
                t2 = pc()
                tap.__exit__(None, None, None)
                t3 = pc()
                if fp is not None:
                    fp.resolve()
                t4 = pc()
                _ = [resolved(s).to_json() for s in tap.summaries.values()]
                t5 = pc()
                ph.update(enter=t1 - t0, forward=t2 - t1, exit=t3 - t2, resolve=t4 - t3, json=t5 - t4)
        sync()
        ph["total"] = pc() - t0
        return ph

    rounds = alternate(VARIANTS, one, a.rounds, warmup=3)
    got = {v: {p: [r[p] for r in rounds[v] if p in r] for p in PHASES} for v in VARIANTS}
    med = {v: {p: statistics.median(got[v][p]) * 1e6 for p in PHASES} for v in VARIANTS}
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"tap phases: {name}, torch {torch.__version__}, hidden {a.hidden}, {a.num_layers} layers, {a.dtype}, "
          f"{a.tokens} token(s), {'9 all-reduces (world 1), ' if a.collectives else ''}"
          f"median of {a.rounds} rounds, microseconds")
    print(f"{'variant':<12} " + " ".join(f"{p:>9}" for p in PHASES) + "   x off")
    for v in VARIANTS:
        print(f"{v:<12} " + " ".join(f"{med[v][p]:>9.1f}" for p in PHASES) +
              f"   {med[v]['total'] / med['off']['total']:.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tap_phases.json"), "w") as f:
        json.dump({"bench": "tap_phases", "device": name, "torch": torch.__version__, "hidden": a.hidden,
                   "num_layers": a.num_layers, "dtype": a.dtype, "tokens": a.tokens, "rounds": a.rounds,
                   "collectives": a.collectives,
                   "median_us": med}, f, indent=1)
    if a.profile:                      # where the host's time goes in one variant (cProfile inflates Python)
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(30):
            one(a.profile)
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumtime").print_stats("tpprobe", 40)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
