"""Decode with CUDA graphs on: graph replay with and without the fingerprint taps.

    python bench/graph_decode.py --tp 1|2 [--hidden 7168] [--ffn 18432] [--num-layers 4]
        [--tokens 1,8,64] [--rounds 15] [--iters 50] [--out FILE.json]

The built-in model (bf16, Kimi width: hidden 7168, 56 heads, ffn 18432) at tp 1, or tp 2 over
NCCL with the all-reduces inside the graph (two processes, one GPU each). Per batch size, two
graphs of the same model are captured: `plain` (the forward), `taps` (the forward with the
GraphTap: one fused fingerprint per capture point and per all-reduce input and output, into the
static buffer, on a side stream after one staging copy per point) and `taps_same_stream` (the
fingerprints on the forward's own stream, no staging); each taps replay is followed by its one D2H
copy of the static buffer (pinned, non-blocking), as the plugin does per step. Rounds rotate the
three variants; each round
times `--iters` back-to-back replays with CUDA events (one sync per round); the table gives the
median per replay and the ratio. Also measured: the host combine of one step's fingerprints
(`read()` after a sync), the static buffer and scratch bytes, and the graph pool's extra memory.
Weights are drawn on the GPU (tpprobe.engines.builtin.graph.device_weights).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _build(ctx, a):
    from tpprobe.engines.builtin.graph import device_weights
    from tpprobe.engines.builtin.model import BuiltinConfig, TPModel

    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, vocab=1024,
                        dtype=torch.bfloat16, layer_ids=[-1, 1, 3])
    model = TPModel(device_weights(cfg, ctx.device), ctx, cfg).to(ctx.device).eval()
    model.set_eagle3_layers_to_capture(cfg.layer_ids)
    return model, cfg


def _time(gf, ids, iters, taps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        gf(ids)
        if taps:
            gf.slots.copy_to_host()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


def bench_rank(ctx, a) -> dict:
    import torch.distributed as dist

    from tpprobe.engines.builtin.graph import GraphedForward
    model, cfg = _build(ctx, a)
    out = {}
    for tokens in a.tokens:
        mem0 = torch.cuda.memory_allocated(ctx.device)
        plain = GraphedForward(model, tokens, ctx.device, taps=False, vocab=cfg.vocab)
        mem1 = torch.cuda.memory_allocated(ctx.device)
        same = GraphedForward(model, tokens, ctx.device, taps=True, vocab=cfg.vocab, side_stream=False)
        mem2 = torch.cuda.memory_allocated(ctx.device)
        taps = GraphedForward(model, tokens, ctx.device, taps=True, vocab=cfg.vocab, side_stream=True)
        mem3 = torch.cuda.memory_allocated(ctx.device)
        ids = torch.randint(0, cfg.vocab, (tokens,), device=ctx.device)
        variants = {"plain": plain, "taps_same_stream": same, "taps": taps}
        for _ in range(3):
            for name, gf in variants.items():
                _time(gf, ids, a.iters, name != "plain")
        rows = {n: [] for n in variants}
        names = list(variants)
        for r in range(a.rounds):
            if ctx.world_size > 1:
                dist.barrier()
            for name in names[r % 3:] + names[:r % 3]:       # rotate the order every round
                rows[name].append(_time(variants[name], ids, a.iters, name != "plain"))
        # the host side of one step: sync, one D2H copy, combine every slot
        host = []
        for _ in range(20):
            taps(ids)
            torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            fps = taps.slots.read()
            host.append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[str(tokens)] = {
            "plain_ms": med["plain"], "taps_ms": med["taps"], "ratio": med["taps"] / med["plain"],
            "taps_same_stream_ms": med["taps_same_stream"],
            "ratio_same_stream": med["taps_same_stream"] / med["plain"],
            "plain_min_ms": min(rows["plain"]), "taps_min_ms": min(rows["taps"]),
            "rounds": rows, "slots": len(fps), "host_read_combine_ms": statistics.median(host),
            "static_bytes": taps.slots.nbytes, "static_bytes_same_stream": same.slots.nbytes,
            "graph_extra_bytes_plain": mem1 - mem0, "graph_extra_bytes_taps_same_stream": mem2 - mem1,
            "graph_extra_bytes_taps": mem3 - mem2,
            "allreduces_in_graph": len(taps.tap.allreduces)}
        del plain, same, taps, variants
        torch.cuda.empty_cache()
    return out


def _worker(rank, world, init, a, q):
    import torch.distributed as dist

    from tpprobe.core.target import RankContext
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        ctx = RankContext(rank, world, rank, torch.device("cuda", rank), "nccl")
        res = bench_rank(ctx, a)
        q.put((rank, res))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        import traceback
        q.put((rank, "".join(traceback.format_exception(e))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--ffn", type=int, default=18432)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    a.tokens = [int(x) for x in a.tokens.split(",")]
    if a.tp == 1:
        from tpprobe.core.target import RankContext
        res = {0: bench_rank(RankContext(0, 1, 0, torch.device("cuda", 0), "none"), a)}
    else:
        import torch.multiprocessing as mp
        c = mp.get_context("spawn")
        q = c.Queue()
        init = os.path.join(tempfile.mkdtemp(), "rdzv")
        ps = [c.Process(target=_worker, args=(r, a.tp, init, a, q)) for r in range(a.tp)]
        for p in ps:
            p.start()
        res = {}
        for _ in range(a.tp):
            r, v = q.get(timeout=540)
            if isinstance(v, str):
                print(f"rank {r} failed:\n{v}", file=sys.stderr)
                for p in ps:
                    p.kill()
                sys.exit(1)
            res[r] = v
        for p in ps:
            p.join(60)
    print(f"CUDA-graph decode, built-in model bf16, hidden {a.hidden}, {a.num_layers} layers, ffn {a.ffn}, "
          f"tp {a.tp} ({torch.cuda.get_device_name(0)}, torch {torch.__version__}); median of {a.rounds} "
          f"rounds x {a.iters} replays")
    print("taps = fingerprints on a side stream (points staged by one copy each); same = on the "
          "forward's stream")
    print(f"{'tokens':>6} {'rank':>4} {'plain ms':>9} {'taps ms':>9} {'x plain':>8} {'same ms':>9} "
          f"{'x plain':>8} {'slots':>5} {'host read ms':>12} {'static B':>9}")
    for r, per in sorted(res.items()):
        for t, v in per.items():
            print(f"{t:>6} {r:>4} {v['plain_ms']:9.4f} {v['taps_ms']:9.4f} {v['ratio']:8.3f} "
                  f"{v['taps_same_stream_ms']:9.4f} {v['ratio_same_stream']:8.3f} {v['slots']:5d} "
                  f"{v['host_read_combine_ms']:12.3f} {v['static_bytes']:9d}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if a.tp > 1 else None,
                       "per_rank": {str(r): v for r, v in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
