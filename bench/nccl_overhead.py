"""The probe's overhead at tp 2 over NCCL, measured side by side in one run.

    python bench/nccl_overhead.py [--nproc 2] [--hidden 7168] [--num-layers 4] [--dtype bfloat16]
        [--prefill 8192] [--decode 1,8,64] [--iters 7] [--decode-iters 30] [--out DIR]

Starts --nproc ranks (one GPU each, NCCL, the built-in model, weights drawn on the GPU) and times
one forward per variant, alternating the variants (so drift hits all alike), median of N:
  off          the bare forward, no hooks, the audit's kernels and doors released (until 2026-12-01
               they stayed registered from the previous variant's Tap, so off paid their pass-through
               on every collective: the --collectives ratios before then are low by that much)
  idle         the bare forward between checked ones: no Tap, the audit left as a Tap's exit leaves it
               (its kernels registered, ProcessGroup's doors as the variant sets them)
  installed    Tap installed (every hook and the all-reduce audit, with CUDA progress events),
               keeping nothing
  full         what `--exchange full` keeps: a copy of every point and every all-reduce's in/out
  fingerprint  what `--exchange fingerprint` does: the 3 EAGLE-3 slots (and embed.*) kept, every
               other point and every audited all-reduce's in/out fingerprinted by the fused kernel,
               queued during the forward and read with ONE device-to-host copy after it
With --kernel, installed_kernel / fingerprint_kernel: the same with ProcessGroup's doors closed
(every collective through the audit's dispatcher kernel, as before the doors).  With
--python, installed_python / fingerprint_python: the same without the C module
(fingerprint/triton/native.py: allreduce's door in C, the fingerprint launches queued from C):
every collective through the Python door, every launch queued from Python.
Each timing runs from a synchronised start to the end of the forward's work on the device (and,
for fingerprint, the host having its fingerprints); `off` releases the audit and registers it again
with an untimed forward after each (harness.settled), so no timed forward runs cold behind either.
Printed and written: the ratio of the medians, and the median and quartiles of each round's own ratio
(harness.paired: a host whose speed drifts moves a round's two timings alike).  Rank 0 writes
nccl_overhead.json to --out.
Targets: fingerprint <= 1.05x off in prefill, <= 1.2x in eager decode; idle 1.00x within noise.
"""
import argparse
import os
import queue
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.harness import alternate, medians, paired, settled, write_json  # noqa: E402
from bench.hook_overhead import weights_on  # noqa: E402
from tpprobe.capture.points import id_point  # noqa: E402
from tpprobe.fingerprint.reference import Deferred, resolved  # noqa: E402
from tpprobe.capture import audit  # noqa: E402
from tpprobe.capture.hooks import Tap  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel  # noqa: E402
from tpprobe.core.target import RankContext  # noqa: E402

VARIANTS = ["off", "idle", "installed", "full", "fingerprint"]


def extra_variants(a) -> list:
    return VARIANTS + (["installed_kernel", "fingerprint_kernel"] if a.kernel else []) + \
        (["installed_python", "fingerprint_python"] if a.python else [])


def worker(rank: int, a, port: int, q):
    if a.python:
        os.environ["TPPROBE_NATIVE"] = "1"     # the C module built, to be timed against the Python paths
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(rank))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    os.makedirs(a.out, exist_ok=True)          # the profiles are written here before main's JSON
    dist.init_process_group("nccl", device_id=dev)
    dtype = getattr(torch, a.dtype)
    layer_ids = [-1, 1, 3]
    variants = extra_variants(a)
    out = {"rows": []}
    for tokens, iters in ([(a.prefill, a.iters)] if a.prefill else []) + [(n, a.decode_iters) for n in a.decode]:
        cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=2 * a.hidden,
                            vocab=a.vocab, tokens=tokens, dtype=dtype, layer_ids=layer_ids)
        ctx = RankContext(rank=rank, world_size=a.nproc, local_rank=rank, device=dev, backend="nccl")
        if "model" not in out:
            with torch.no_grad():
                out["model"] = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
            out["model"].set_eagle3_layers_to_capture(layer_ids)
        model = out["model"]
        if a.collectives and a.nproc == 1 and "reduces" not in out:
            # at tp 1 the model reduces nothing: all-reduce the embedding's and every row-parallel
            # output over the world-1 NCCL group, where a tp-2 model issues its all-reduces, so the
            # audit's and the fingerprints' host cost per collective is timed on a real communicator
            out["reduces"] = [m.register_forward_hook(lambda mod, args, o: dist.all_reduce(o))
                              for m in [model.embed_tokens] + [x for l in model.layers
                                                               for x in (l.self_attn.o_proj, l.mlp.down_proj)]]
        g = torch.Generator(device=dev).manual_seed(tokens)
        ids = torch.randint(0, a.vocab, (tokens,), generator=g, device=dev)
        keep_ids = {id_point(i) for i in layer_ids}

        def bare():
            with torch.no_grad():
                model(ids)

        def run(v):
            audit.set_doors(not v.endswith("_kernel"))
            py = v.endswith("_python")          # no C module: the Python door, launches queued from Python
            v = v.replace("_kernel", "").replace("_python", "")
            if v == "off":       # probe off: none of the audit's kernels or doors on the way
                settled(bare, audit.release)
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                if v in ("off", "idle"):
                    model(ids)
                elif v == "installed":
                    with Tap(model, keep=lambda n: False, keep_allreduce_tensors=False, progress=Progress()) as tap:
                        if py:
                            tap.auditor.native = None
                        model(ids)
                elif v == "full":
                    with Tap(model, keep=lambda n: True, keep_allreduce_tensors=True, progress=Progress()):
                        model(ids)
                else:
                    fp = Deferred(0x7470, 32)
                    if py:
                        fp.fast = lambda: fp
                    keep = lambda n: n in keep_ids or n.startswith("embed") or n.endswith("in_norm")  # noqa: E731
                    with Tap(model, keep=keep, summarize=fp, keep_allreduce_tensors=False,
                             progress=Progress()) as tap:
                        if py:
                            tap.auditor.native = None
                        model(ids)
                    fp.resolve()
                    _ = [resolved(s).to_json() for s in tap.summaries.values()]
            torch.cuda.synchronize()
            t = time.perf_counter() - t0
            if v == "off":       # registered again outside the timing (the next Tap would pay 5 ms)
                settled(bare, audit.sync)
            return t

        times = alternate(variants, run, iters, warmup=2)      # warm-up: the kernels compile once
        med = medians(times)
        pair = paired(times)
        if a.profile and rank == 0 and tokens == min(a.decode or [0]):
            import cProfile
            import io
            import pstats
            for v in ("installed", "fingerprint"):       # where the host's time goes, per variant
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    run(v)
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(45)
                with open(os.path.join(a.out, f"profile_{v}_{tokens}tok.txt"), "w") as f:
                    f.write(buf.getvalue())
        out["rows"].append({"phase": "prefill" if tokens == a.prefill else "decode", "tokens": tokens,
                            "iters": iters, **{f"{v}_ms": med[v] * 1e3 for v in variants},
                            **{f"{v}_x": med[v] / med["off"] for v in variants[1:]},
                            # round by round (harness.paired): quartiles of each round's ratio to off
                            **{f"{v}_paired_x": pair[v] for v in variants[1:]},
                            "all_ms": {v: [t * 1e3 for t in times[v]] for v in variants}})
    if rank == 0:
        q.put({"rows": out["rows"], "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "collectives_at_world_1": bool(out.get("reduces")),
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "nproc": a.nproc, "hidden": a.hidden,
               "num_layers": a.num_layers, "ffn": 2 * a.hidden, "dtype": a.dtype, "heads": a.heads})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill", type=int, default=8192, help="0: no prefill row")
    ap.add_argument("--decode", default="1,8,64")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--decode-iters", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--collectives", action="store_true", help="with --nproc 1: all-reduce the embedding's and "
                    "every row-parallel output over the world-1 NCCL group, as a tp-2 model does (the per-collective "
                    "host cost on one GPU)")
    ap.add_argument("--python", action="store_true", help="also time installed / fingerprint without the C "
                    "module (fingerprint/triton/native.py): the Python door, every launch queued from Python")
    ap.add_argument("--kernel", action="store_true", help="also time installed / fingerprint with "
                    "ProcessGroup's doors closed (capture/audit/: every collective through the audit's "
                    "dispatcher kernel, as before the doors), side by side")
    ap.add_argument("--profile", action="store_true", help="also cProfile 20 decode forwards (rank 0, "
                    "smallest decode size) of installed and fingerprint into --out/profile_*.txt")
    a = ap.parse_args()
    a.decode = [int(x) for x in a.decode.split(",") if x]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, a, port, q)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    res, deadline = None, time.time() + 540
    while res is None:           # a rank that dies ends the bench now, not at the deadline
        try:
            res = q.get(timeout=2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) or time.time() > deadline:
                for p in procs:
                    p.kill()
                sys.exit(f"nccl_overhead: the ranks ended without a result (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=30)
    res["bench"] = "nccl_overhead"
    res["targets"] = {"fingerprint_x prefill": "<= 1.05", "fingerprint_x decode": "<= 1.2",
                      "idle_x": "1.00 within noise"}
    print(f"tp {a.nproc} NCCL, {res['gpu']}, torch {res['torch']}, NCCL {res['nccl']}, hidden {a.hidden}, "
          f"{a.num_layers} layers, {a.dtype}" + (", every row output all-reduced at world 1" if
                                                 res.get("collectives_at_world_1") else "") + "; median ms (x off)")
    shown = extra_variants(a)
    print(f"{'phase':<8} {'tokens':>6} " + " ".join(f"{v:>18}" for v in shown))
    for r in res["rows"]:
        cells = [f"{r['off_ms']:>18.3f}"] + [f"{r[v + '_ms']:>10.3f} ({r[v + '_x']:.3f}x)" for v in shown[1:]]
        print(f"{r['phase']:<8} {r['tokens']:>6} " + " ".join(cells))
    print("round by round, each round's ratio to off: median [first, third quartile]")
    for r in res["rows"]:
        print(f"{r['phase']:<8} {r['tokens']:>6} " + " ".join(
            f"{v} {r[v + '_paired_x'][1]:.3f} [{r[v + '_paired_x'][0]:.3f}, {r[v + '_paired_x'][2]:.3f}]"
            for v in shown[1:]))
    write_json(a.out, "nccl_overhead.json", res)


if __name__ == "__main__":
    main()
