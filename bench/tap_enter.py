"""The Tap's install and removal alone, per forward.

    python bench/tap_enter.py [--device cuda|cpu] [--n 500] [--profile]

The built-in model (4 layers; hidden 256: the install does not depend on the width) on --device;
times Tap construction, enter + exit, and with --profile prints cProfile's top 25 (tottime) of
--n enter + exit cycles.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.hook_overhead import weights_on  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel  # noqa: E402
from tpprobe.core.target import RankContext  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = BuiltinConfig(num_layers=4, hidden=256, heads=4, ffn=512, vocab=1024, tokens=1, dtype=torch.bfloat16,
                        layer_ids=[-1, 1, 3])
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="gloo")
    with torch.no_grad():
        model = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
    model.set_eagle3_layers_to_capture([-1, 1, 3])

    def make():
        return Tap(model, keep=lambda n: False, keep_allreduce_tensors=False, progress=Progress())

    def cycle():
        tap = make()
        tap.__enter__()
        tap.__exit__(None, None, None)

    for _ in range(50):
        cycle()
    res = {}
    for name, fn in (("construct", make), ("construct + enter + exit", cycle)):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.n):
                fn()
            best.append((time.perf_counter() - t0) / a.n * 1e6)
        res[name] = min(best)
    print(f"tap enter: {dev}, torch {torch.__version__}, python {sys.version.split()[0]}; best of 5 x {a.n}, us: " +
          ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.n):
            cycle()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
