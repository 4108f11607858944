"""Decode under torch.compile(mode="reduce-overhead"): replays with and without the fingerprint taps inside.

    python bench/compiled_decode.py [--hidden 7168] [--ffn 18432] [--num-layers 4] [--tokens 1,8,64]
        [--rounds 15] [--iters 50] [--backend inductor|cudagraphs] [--out DIR]

The built-in model (bf16, Kimi width, tp 1) compiled twice from the same weights: `plain` (the
model) and `taps` (the model with `CompiledTaps`: one fused fingerprint per capture point, through
the `tpprobe::fp_into` op, inside the graph cudagraph trees record). Each step is
`cudagraph_mark_step_begin()` and one call of the compiled model; the taps step adds the one D2H
copy of the static slot buffer (pinned, non-blocking), as bench/graph_decode.py does for the
hand-captured graph. Rounds alternate the two (the order reversed every other round); each round
times --iters back-to-back steps with CUDA events (one sync per round); the table gives the median
per step and the ratio. Also: the host combine of one step's fingerprints (`read()` after a sync)
and the compile time of each variant. Target: taps <= 1.05x plain. Writes compiled_decode.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--ffn", type=int, default=18432)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "cudagraphs"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from tpprobe.engines.builtin.graph import aux_against_graph, compile_model, run_compiled
    from tpprobe.engines.builtin.graph import FP_K, FP_SEED, device_weights
    from tpprobe.engines.builtin.model import BuiltinConfig, TPModel
    from tpprobe.capture.graph_tap import CompiledTaps
    from tpprobe.core.target import RankContext

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # two models with one forward's code: Dynamo must tell them apart by their hooks, or the second
    # runs the first one's graph (it skips the hook guards by default)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, vocab=1024,
                        dtype=torch.bfloat16, layer_ids=[-1, 1, 3])
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="nccl")
    w = device_weights(cfg, dev)
    rows = {}
    for tokens in [int(x) for x in a.tokens.split(",") if x]:
        torch._dynamo.reset()
        models = {}
        for v in ("plain", "taps"):
            m = TPModel(w, ctx, cfg).to(dev).eval()
            m.set_eagle3_layers_to_capture(cfg.layer_ids)
            models[v] = m
        ids = torch.randint(0, cfg.vocab, (tokens,), device=dev)
        with torch.no_grad():
            taps = CompiledTaps(models["taps"], ids, seed=FP_SEED, k=FP_K)
            fast, compile_s = {}, {}
            for v, m in models.items():
                t0 = time.perf_counter()
                fast[v] = compile_model(m, a.backend)
                for _ in range(3):
                    run_compiled(fast[v], ids)
                torch.cuda.synchronize()
                compile_s[v] = time.perf_counter() - t0

            def step_time(v):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(a.iters):
                    run_compiled(fast[v], ids)
                    if v == "taps":
                        taps.slots.copy_to_host()
                e.record()
                e.synchronize()
                return s.elapsed_time(e) / a.iters

            for v in ("plain", "taps"):
                step_time(v)
            got = {"plain": [], "taps": []}
            for r in range(a.rounds):
                for v in (("plain", "taps") if r % 2 == 0 else ("taps", "plain")):
                    got[v].append(step_time(v))
            host = []
            for _ in range(20):
                run_compiled(fast["taps"], ids)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fps = taps.read()
                host.append((time.perf_counter() - t0) * 1e3)
            # the taps ran inside the replayed graph: new ids, and each EAGLE-3 slot the graph returned,
            # fingerprinted after it, equals the in-graph fingerprint of its point
            other = torch.randint(0, cfg.vocab, (tokens,), device=dev)
            out = run_compiled(fast["taps"], other)
            packed = out[1].clone()
            check = aux_against_graph(taps.read(), packed, list(cfg.layer_ids), cfg.hidden)
            if not check or not all(c["equal"] for c in check.values()):
                sys.exit(f"compiled_decode: in-graph fingerprints differ from the replay's values: {check}")
            taps.remove()
        med = {v: statistics.median(x) for v, x in got.items()}
        rows[str(tokens)] = {"plain_ms": med["plain"], "taps_ms": med["taps"], "ratio": med["taps"] / med["plain"],
                             "rounds": got, "points": len(fps), "host_read_combine_ms": statistics.median(host),
                             "static_bytes": taps.slots.nbytes, "compile_s": compile_s,
                             "aux_equal_in_graph": sorted(check)}
    res = {"bench": "compiled_decode", "backend": a.backend, "gpu": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "hidden": a.hidden, "ffn": a.ffn, "num_layers": a.num_layers,
           "iters": a.iters, "rounds": a.rounds, "target": "taps <= 1.05x plain", "rows": rows}
    print(f"torch.compile ({a.backend}) decode, {res['gpu']}, torch {res['torch']}, hidden {a.hidden}, "
          f"{a.num_layers} layers, ffn {a.ffn}; median ms per step")
    print(f"{'tokens':>6} {'plain':>8} {'taps':>8} {'x plain':>8} {'points':>6} {'host read ms':>12} {'compile s':>14}")
    for t, r in rows.items():
        print(f"{t:>6} {r['plain_ms']:8.3f} {r['taps_ms']:8.3f} {r['ratio']:8.3f} {r['points']:6d} "
              f"{r['host_read_combine_ms']:12.3f} {r['compile_s']['plain']:6.1f}/{r['compile_s']['taps']:6.1f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"compiled_decode_{a.backend}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
