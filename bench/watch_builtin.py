"""The watch's cost (TPPROBE_WATCH=N, tpprobe/engines/watch.py) on the built-in model, one process, side by side.

    python bench/watch_builtin.py [--small] [--decode 1,8,64] [--prefill 8192] [--iters 7] [--decode-iters 30]
        [--reps 10] [--no-graph] [--out FILE.json]

The built-in model of bench/graph_decode.py (hidden 7168, 56 heads, ffn 18432, 4 layers, bf16, weights drawn on
the GPU); on CPU (or --small) hidden 256, 4 heads, ffn 512, float32. World 1: one process, a world-1 NCCL group
on CUDA (gloo on CPU), the embedding's and every row-parallel output all-reduced over it where a tp-2 model
reduces (bench/nccl_overhead.py --collectives: 9 all-reduces the watch checks). Each forward is driven the way
both engines' plugins drive it (`watched(step)`, then `forward(side, ...)`), variants alternated, median of N
rounds; a decode round is --reps forwards of its variant back to back (so a forward follows one of its own
kind, as in an engine), each timed from a synchronised start to the end of its work on the device:
  off             no watch (the audit's kernels released: an engine without the plugin)
  idle            a watched engine's unchecked forward (N = 512, a step not a multiple of N)
  watch 1         N = 1: every forward checked; the audit stays registered between forwards
  watch 512       N = 512 (the default), its checked forward (a step multiple of N): the audit registered
                  again on the way in and released on the way out, as at any N > 1
Per checked forward, where its time goes, from the watch's own phase timing (`status()["seconds"]`): the
forward in the Tap, the record, the exchange (none at world 1), the check. The amortised cost per forward at
N = 512 is (checked + 511 x idle) / 512, from the N = 512 checked forward and from watch 1's. The exchange a
tp > 1 rank pays is sketched by one `all_gather_object` of a real record over a world-1 gloo group (pickle, no
peers to wait for). On CUDA also (--no-graph: not) the CUDA-graph decode of bench/graph_decode.py: `graph` the
plain replay, `graph checked` the tapped replay (capture/graph_tap.py), its static buffer read, the record and
the watch's check, the plan docs/watch.md describes (the runner replays the tapped graph on one forward in N).
Every checked forward must be healthy with full coverage (asserted: a bench of a broken watch says nothing).
"""
import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import alternate, medians  # noqa: E402
from tpprobe.capture import audit  # noqa: E402
from tpprobe.core.target import RankContext  # noqa: E402
from tpprobe.engines import watch  # noqa: E402
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel, full_weights  # noqa: E402

EVERY = watch.DEFAULT_EVERY
VARIANTS = ["off", "idle", "watch 1", f"watch {EVERY}"]


def build(a, ctx):
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, vocab=1024,
                        dtype=a.torch_dtype, layer_ids=[-1, 1, 3])
    if ctx.device.type == "cuda":
        from tpprobe.engines.builtin.graph import device_weights
        weights = device_weights(cfg, ctx.device)
    else:
        weights = full_weights(cfg)
    with torch.no_grad():
        model = TPModel(weights, ctx, cfg).to(ctx.device).eval()
    model.set_eagle3_layers_to_capture(cfg.layer_ids)
    # world 1 reduces nothing: all-reduce over the world-1 group where a tp-2 model does (in place)
    for m in [model.embed_tokens] + [x for lay in model.layers for x in (lay.self_attn.o_proj, lay.mlp.down_proj)]:
        m.register_forward_hook(lambda mod, args, out: dist.all_reduce(out))
    return model, cfg


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def quiet(fn, *args):
    with contextlib.redirect_stderr(io.StringIO()):
        return fn(*args)


def exchange_cost(side, model, ids, gloo, n=20) -> float:
    """ms of one all_gather_object of a real record (the watch's `mine`) over a world-1 gloo group; also checks
    that record: healthy, every all-reduce of the model audited."""
    from tpprobe.capture.hooks import Tap
    from tpprobe.capture.record import resolve_summaries
    from tpprobe.engines.step import step_record, step_settings
    from tpprobe.fingerprint.reference import PROBE_K, PROBE_SEED, Deferred

    fps = Deferred(PROBE_SEED, PROBE_K)
    with torch.no_grad(), Tap(model, input_ids=ids, keep=lambda n: False, keep_allreduce_tensors=False,
                              summarize=fps) as tap:
        model(ids)
    resolve_summaries(tap, fps, True)
    want = 1 + 2 * len(model.layers)
    assert len(tap.allreduces) == want, f"the audit saw {len(tap.allreduces)} all-reduces, not {want}"

    class Keep:
        admit = staticmethod(lambda name, t: False)
    rec = step_record(tap, model=model, rank=0, world=1, input_ids=ids, aux=None, budget=Keep, t_forward=0.0,
                      extra={"source": side.source, "step": 0})
    settings = step_settings(rec, model, backend=side.backend, tokens=int(ids.shape[0]), mode="decode", step=0,
                             par=side.par, slots=([], []))
    meta = rec.to_json()
    found = watch.check({0: meta}, {**settings, "world_size": 1})["findings"]
    assert not found, f"a healthy record has findings: {found}"
    mine = (meta, settings, None)
    out = [None]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_gather_object(out, mine, group=gloo)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def eager_rows(a, side, model, ctx, gloo) -> list:
    rows, steps = [], {"idle": 1, "watch 1": 0, f"watch {EVERY}": 0}
    state = {"every": None}
    for tokens, iters in [(a.prefill, a.iters)] + [(t, a.decode_iters) for t in a.decode]:
        mode = "prefill" if tokens == a.prefill else "decode"
        reps = 1 if mode == "prefill" else a.reps
        g = torch.Generator(device=ctx.device).manual_seed(tokens)
        ids = torch.randint(0, 1024, (tokens,), generator=g, device=ctx.device)
        phases = {v: [] for v in VARIANTS[2:]}

        def run(v):
            every = {"off": 0, "idle": EVERY, "watch 1": 1}.get(v, EVERY)
            if state["every"] != every:
                quiet(watch.set_every, every)
                state["every"] = every
            if v == "watch 1":
                audit.sync()        # N = 1: registered since the last forward
            else:
                audit.release()     # off: never registered; N > 1: released after each checked forward
            sync(ctx.device)
            t = 0.0
            for _ in range(reps):       # back to back: what a forward follows is a forward of its variant
                step = steps.get(v, 0)
                if v in steps:
                    steps[v] += {"idle": 1 if (step + 1) % EVERY else 2, "watch 1": 1}.get(v, EVERY)
                before, st0 = watch.status(), dict(watch.status()["seconds"])
                t0 = time.perf_counter()
                with torch.no_grad():
                    if v != "off" and watch.watched(step):
                        watch.forward(side, model, lambda: model(ids), ids, mode, step)
                    else:
                        model(ids)
                sync(ctx.device)
                t += time.perf_counter() - t0
                after = watch.status()
                checked = after["checked"] - before["checked"]
                assert checked == (v in phases), f"{v}: {checked} forward(s) checked, step {step}"
                if checked:     # healthy, full coverage (no warning), the watch still on
                    assert after["healthy"] == before["healthy"] + 1 and not after["failing"] \
                        and not after["warned"] and after["stopped"] is None, \
                        f"{v} at step {step}: not healthy: {json.dumps(after)}"
                    phases[v].append({k: 1e3 * (s - st0.get(k, 0.0)) for k, s in after["seconds"].items()})
            return t / reps

        times = alternate(VARIANTS, run, iters, warmup=2)
        med = {v: 1e3 * m for v, m in medians(times).items()}
        row = {"phase": mode, "tokens": tokens, "iters": iters, **{f"{v}_ms": med[v] for v in VARIANTS},
               **{f"{v}_x": med[v] / med["off"] for v in VARIANTS[1:]}}
        for v, ps in phases.items():
            ps = ps[-iters * reps:]     # the timed rounds, not the warm-up
            row[f"{v} phases_ms"] = {k: statistics.median(p.get(k, 0.0) for p in ps) for k in ps[0]}
        for v, name in ((f"watch {EVERY}", "amortised"), ("watch 1", "amortised_from_n1")):
            row[f"{name}_{EVERY}_ms"] = (med[v] + (EVERY - 1) * med["idle"]) / EVERY
            row[f"{name}_{EVERY}_x"] = row[f"{name}_{EVERY}_ms"] / med["off"]
        row["exchange_world1_gloo_ms"] = exchange_cost(side, model, ids, gloo)
        row["all_ms"] = {v: [1e3 * t for t in ts] for v, ts in times.items()}
        rows.append(row)
        print(f"  {mode} {tokens}: off {med['off']:.3f} ms, " + ", ".join(
            f"{v} {med[v]:.3f} ({med[v] / med['off']:.3f}x)" for v in VARIANTS[1:]), flush=True)
    return rows


def graph_rows(a, model, cfg, ctx) -> list:
    """CUDA-graph decode: the plain replay against the tapped replay + read + record + the watch's check."""
    from tpprobe.capture.record import Sketch, rank_record
    from tpprobe.engines.builtin.graph import FP_K, FP_SEED, GraphedForward
    from tpprobe.formats.settings import run_settings

    rows = []
    for tokens in a.decode:
        gfs = {v: GraphedForward(model, tokens, ctx.device, taps=v != "graph", vocab=cfg.vocab)
               for v in ("graph", "graph checked")}
        ids = torch.randint(0, cfg.vocab, (tokens,), device=ctx.device)
        settings = run_settings(world_size=1, backend="builtin (watch bench, CUDA graph)", dtype=cfg.dtype,
                                layer_ids=[], num_layers=cfg.num_layers, hidden=cfg.hidden, tokens=tokens,
                                arch="builtin", model="builtin", exchange="fingerprint (CUDA graph)")
        phases = []

        def run(v):
            sync(ctx.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                gfs[v](ids)
                sync(ctx.device)
                if v == "graph":
                    return time.perf_counter() - t0
                t1 = time.perf_counter()
                view = gfs[v].read()
                t2 = time.perf_counter()
                meta = rank_record(view, rank=0, world=1, input_ids=None, model=model, hidden=cfg.hidden,
                                   device=ctx.device, fingerprints=Sketch(FP_SEED, FP_K), with_coverage=False).to_json()
                t3 = time.perf_counter()
                found = watch.check({0: meta}, settings)["findings"]
                t4 = time.perf_counter()
            assert len(meta["allreduces"]) == 1 + 2 * cfg.num_layers, f"{len(meta['allreduces'])} all-reduces tapped"
            assert not found, f"a healthy graph replay has findings: {found}"
            phases.append({"replay (tapped)": t1 - t0, "read": t2 - t1, "record": t3 - t2, "check": t4 - t3})
            return t4 - t0

        times = alternate(["graph", "graph checked"], run, a.decode_iters, warmup=2)
        med = {v: 1e3 * m for v, m in medians(times).items()}
        ps = phases[-a.decode_iters:]
        amort = (med["graph checked"] + (EVERY - 1) * med["graph"]) / EVERY
        rows.append({"tokens": tokens, "iters": a.decode_iters, "graph_ms": med["graph"],
                     "graph_checked_ms": med["graph checked"], "graph_checked_x": med["graph checked"] / med["graph"],
                     "graph_checked phases_ms": {k: 1e3 * statistics.median(p[k] for p in ps) for k in ps[0]},
                     f"graph_amortised_{EVERY}_ms": amort, f"graph_amortised_{EVERY}_x": amort / med["graph"],
                     "static_bytes": gfs["graph checked"].slots.nbytes,
                     "all_ms": {v: [1e3 * t for t in ts] for v, ts in times.items()}})
        print(f"  graph decode {tokens}: replay {med['graph']:.3f} ms, checked {med['graph checked']:.3f} ms, "
              f"amortised at N={EVERY} {amort:.4f} ms ({amort / med['graph']:.4f}x)", flush=True)
        gfs.clear()
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="the CPU shapes (the default without CUDA)")
    ap.add_argument("--decode", default="1,8,64")
    ap.add_argument("--prefill", type=int, default=0, help="prefill tokens (default 8192; --small: 128)")
    ap.add_argument("--iters", type=int, default=0, help="rounds of the prefill (default 7; --small: 3)")
    ap.add_argument("--decode-iters", type=int, default=0, help="rounds of each decode size (default 30; --small: 4)")
    ap.add_argument("--reps", type=int, default=0,
                    help="decode forwards timed back to back per round (default 10; --small: 2)")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variant")
    ap.add_argument("--out", default="", help="write the results as JSON to this file")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.small
    a.decode = [int(x) for x in a.decode.split(",") if x]
    a.hidden, a.heads, a.ffn, dtype = (7168, 56, 18432, "bfloat16") if cuda else (256, 4, 512, "float32")
    a.torch_dtype, a.prefill = getattr(torch, dtype), a.prefill or (8192 if cuda else 128)
    a.iters, a.decode_iters = a.iters or (7 if cuda else 3), a.decode_iters or (30 if cuda else 4)
    a.reps = a.reps or (10 if cuda else 2)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    init = os.path.join(tempfile.mkdtemp(prefix="tpprobe-watch-bench-"), "rdzv")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            **({"device_id": dev} if cuda else {}))
    gloo = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="nccl" if cuda else "gloo")
    t_all = time.time()
    model, cfg = build(a, ctx)
    device = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    print(f"the watch on the built-in model ({device}, torch {torch.__version__}): hidden {a.hidden}, "
          f"{a.num_layers} layers, ffn {a.ffn}, {dtype}, world 1 ({ctx.backend}, 9 all-reduces per forward); "
          f"median ms per forward (x off)", flush=True)
    with tempfile.TemporaryDirectory(prefix="tpprobe-watch-") as tmp:
        side = watch.Side(rank=0, world=1, cpu_group=gloo, par={"dp_rank": 0, "pp_rank": 0}, extensions=(),
                          source="watch-bench", backend="builtin (watch bench)", root=Path(tmp), max_bytes=1 << 20)
        rows = eager_rows(a, side, model, ctx, gloo)
        st = watch.status()
    res = {"bench": "watch_builtin", "device": device, "torch": torch.__version__, "hidden": a.hidden,
           "heads": a.heads, "ffn": a.ffn, "num_layers": a.num_layers, "dtype": dtype, "world": 1,
           "backend": ctx.backend, "every": EVERY, "reps": a.reps, "rows": rows,
           "watch": {k: st[k] for k in ("checked", "healthy", "failing", "warned", "stopped")}}
    write(a.out, res)           # the eager rows kept if the graph part fails
    if cuda and not a.no_graph:
        audit.release()
        res["graph"] = graph_rows(a, model, cfg, ctx)
    res["seconds"] = time.time() - t_all
    print(f"{'phase':<8}{'tokens':>7}{'off ms':>9}{'idle':>8}{'watch 1':>9}{'N=1 phases: Tap/rec/exch/check':>33}"
          f"{'checked@' + str(EVERY):>12}{'amortised@' + str(EVERY):>15}{'x off':>7}{'gather':>8}")
    for r in rows:
        ph = r["watch 1 phases_ms"]
        print(f"{r['phase']:<8}{r['tokens']:>7}{r['off_ms']:9.3f}{r['idle_x']:8.3f}{r['watch 1_x']:9.2f}"
              f"{'/'.join(f'{x:.2f}' for x in ph.values()):>33}{r[f'watch {EVERY}_ms']:12.2f}"
              f"{r[f'amortised_{EVERY}_ms']:15.4f}{r[f'amortised_{EVERY}_x']:7.3f}{r['exchange_world1_gloo_ms']:8.2f}")
    print(f"{st['checked']} forwards checked, {st['healthy']} healthy, {st['failing']} failing; "
          f"{res['seconds']:.0f} s")
    write(a.out, res)
    dist.destroy_process_group()


def write(out: str, res: dict) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1))
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
