"""The collective audit's and the Tap install's cost on a decode forward, before / after.

    .venv/bin/python bench/audit_overhead.py [--nproc 1] [--hidden 64] [--num-layers 4] [--tokens 1]
        [--iters 41] [--out DIR]

--nproc gloo ranks on the CPU (world 1 by default: the built-in model issues no all-reduce at tp 1,
so what is timed is the per-op cost; --nproc 2 adds the audited all-reduces) run the built-in model's
decode forward (1 token), timing five variants alternately in one run (warm-up, then round-robin in
alternating order, median of N):
  off             the bare forward
  installed_old   Tap installed, keeping nothing, the way it ran before: the audit through its
                  TorchDispatchMode (every aten op through Python) and discovery walked every time
  installed       Tap installed, keeping nothing: the audit's Autograd kernels on the collectives
                  only, discovery cached per model
  fp_old / fp     what `--exchange fingerprint` keeps: the 3 EAGLE-3 slots (and embed.*) copied,
                  every other point fingerprinted (torch path), old / new way
and prints each median and its ratio to `off`; writes audit_overhead.json to --out (rank 0).
The H200 numbers come from bench/nccl_overhead.py (the lead's run).
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.harness import alternate, medians, write_json  # noqa: E402
from bench.hook_overhead import weights_on  # noqa: E402
from tpprobe.capture import hooks  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.points import id_point  # noqa: E402
from tpprobe.fingerprint.reference import fingerprint  # noqa: E402
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel  # noqa: E402
from tpprobe.core.target import RankContext  # noqa: E402

VARIANTS = ["off", "installed_old", "installed", "fp_old", "fp"]


def worker(rank, a, port, q):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.nproc)
    layer_ids = [-1, 1, 3]
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=2 * a.hidden,
                        vocab=a.vocab, tokens=a.tokens, dtype=torch.float32, layer_ids=layer_ids)
    ctx = RankContext(rank=rank, world_size=a.nproc, local_rank=rank, device=torch.device("cpu"),
                      backend="gloo")
    with torch.no_grad():
        model = TPModel(weights_on(cfg, torch.device("cpu")), ctx, cfg).eval()
    model.set_eagle3_layers_to_capture(layer_ids)
    ids = torch.randint(0, a.vocab, (a.tokens,), generator=torch.Generator().manual_seed(0))
    keep_ids = {id_point(i) for i in layer_ids}
    keep3 = lambda n: n in keep_ids or n.startswith("embed") or n.endswith("in_norm")  # noqa: E731
    audits = {}

    def tap(v):
        old = v.endswith("_old")
        if old:
            hooks.PLANS.reset()           # discovery walks the model, as every Tap did before
        t = Tap(model, keep=keep3 if v.startswith("fp") else (lambda n: False), keep_allreduce_tensors=False,
                summarize=(lambda x: fingerprint(x, seed=0, k=32)) if v.startswith("fp") else None)
        t.auditor.use_mode = old           # the audit through its TorchDispatchMode, as before
        return t

    def run(v):
        if a.nproc > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            if v == "off":
                model(ids)
            else:
                with tap(v) as t:
                    model(ids)
                _ = [s.to_json() for s in t.summaries.values()]
                audits[v] = (t.auditor.path.split(" ")[0], len(t.allreduces))
        return time.perf_counter() - t0

    times = alternate(VARIANTS, run, a.iters, warmup=3)
    if rank == 0:
        med = medians(times)
        q.put({"bench": "audit_overhead", "nproc": a.nproc, "hidden": a.hidden, "num_layers": a.num_layers,
               "tokens": a.tokens, "iters": a.iters, "torch": torch.__version__,
               "rows": [{"variant": v, "median_ms": med[v] * 1e3, "x_off": med[v] / med["off"],
                         "audit_path": audits.get(v, ("", 0))[0], "collectives": audits.get(v, ("", 0))[1],
                         "all_ms": [t * 1e3 for t in times[v]]} for v in VARIANTS]})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=41)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a, port, q)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    print(f"audit overhead: {a.nproc} gloo rank(s), built-in model hidden {a.hidden}, {a.num_layers} layers, "
          f"{a.tokens} token(s), median of {a.iters}")
    print(f"{'variant':<14} {'median ms':>10} {'x off':>7}  audit")
    for r in res["rows"]:
        print(f"{r['variant']:<14} {r['median_ms']:>10.3f} {r['x_off']:>7.3f}  {r['audit_path']} "
              f"{r['collectives'] if r['audit_path'] else ''}")
    write_json(a.out, "audit_overhead.json", res)


if __name__ == "__main__":
    main()
