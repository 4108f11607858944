"""Hook overhead of the probe on one forward.

    .venv/bin/python bench/hook_overhead.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--hidden 4096] [--tokens 256] [--num-layers 4] [--ffn H] [--heads 32] [--iters 5] [--out DIR]

The built-in model at tp=1 (RankContext(world_size=1): no collectives), three variants timed
alternately in one run (warm-up, then round-robin, median of N):
  none       the bare forward, no hooks
  installed  Tap installed, capture disabled: keep nothing, no summarize, audit on
  capture3   what `--exchange fingerprint` does: keep the 3 EAGLE-3 slots (and embed.*) as copies,
             fingerprint every other point (fingerprint(t, seed, k=32)), audit on
and prints each variant's median and its ratio to `none`. Writes hook_overhead.json to --out.
Weights are drawn on the target device (the model's own full_weights draws on the CPU in
float32, which takes longer than the benchmark at GPU widths); the forward is the model's.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.harness import alternate, medians, write_json  # noqa: E402
from tpprobe.capture.points import id_point  # noqa: E402
from tpprobe.fingerprint.reference import fingerprint  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel, input_ids  # noqa: E402
from tpprobe.core.target import RankContext  # noqa: E402

FP_SEED, FP_K = 0, 32


def weights_on(cfg: BuiltinConfig, device) -> dict:
    from tpprobe.engines.builtin.graph import device_weights
    return device_weights(cfg, device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=0, help="default: 2 x hidden")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layers", default="-1,1,3")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()

    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    layer_ids = [int(x) for x in a.layers.split(",")]
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn or 2 * a.hidden,
                        vocab=a.vocab, tokens=a.tokens, dtype=dtype, layer_ids=layer_ids)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="none")
    with torch.no_grad():
        model = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
    model.set_eagle3_layers_to_capture(layer_ids)
    ids = input_ids(cfg).to(dev)
    cuda = dev.type == "cuda"
    keep_ids = {id_point(i) for i in layer_ids}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    kept = {}

    def run(variant) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            if variant == "none":
                model(ids)
                n = 0
            elif variant == "installed":
                with Tap(model, keep=lambda n: False, summarize=None, keep_allreduce_tensors=False,
                         audit=True) as tap:
                    model(ids)
                n = len(tap.captures)
            else:
                keep = lambda n: n in keep_ids or n.startswith("embed") or n.endswith("in_norm")  # noqa: E731
                with Tap(model, keep=keep, summarize=lambda t: fingerprint(t, seed=FP_SEED, k=FP_K),
                         keep_allreduce_tensors=False, audit=True) as tap:
                    model(ids)
                # the fingerprints are used on the host right after the forward: count their sync
                _ = [s.to_json() for s in tap.summaries.values()]
                n = len(tap.captures)
        sync()
        kept[variant] = n
        return time.perf_counter() - t0

    variants = ["none", "installed", "capture3"]
    times = alternate(variants, run, a.iters, warmup=a.warmup)
    med = medians(times)
    cap_bytes = a.tokens * a.hidden * torch.tensor([], dtype=dtype).element_size()
    rows = [{"variant": v, "median_s": med[v], "ratio": med[v] / med["none"], "min_s": min(times[v]),
             "max_s": max(times[v]), "kept_tensors": kept[v], "all_s": times[v]} for v in variants]
    res = {"bench": "hook_overhead", "device": str(dev), "gpu": torch.cuda.get_device_name() if cuda else None,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype,
           "hidden": a.hidden, "tokens": a.tokens, "num_layers": a.num_layers, "ffn": cfg.ffn,
           "heads": a.heads, "layer_ids": layer_ids, "iters": a.iters, "capture_bytes": cap_bytes,
           "rows": rows, "targets": {"capture3": "<= 1.05", "installed": "~1.00"}}
    print(f"hook overhead: {dev} {a.dtype} hidden {a.hidden} tokens {a.tokens} layers {a.num_layers} "
          f"ffn {cfg.ffn}, median of {a.iters} (one capture = {cap_bytes / 1e6:.1f} MB)")
    print(f"{'variant':<10} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'x none':>7}")
    for r in rows:
        print(f"{r['variant']:<10} {r['median_s'] * 1e3:>10.2f} {r['min_s'] * 1e3:>9.2f} "
              f"{r['max_s'] * 1e3:>9.2f} {r['ratio']:>7.3f}")
    write_json(a.out, f"hook_overhead_{dev.type}.json", res)


if __name__ == "__main__":
    main()
