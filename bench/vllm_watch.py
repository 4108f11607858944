"""The watch's cost in vLLM's own CPU engine: tokens/s off, with TPPROBE_WATCH=1, and with the default N, side by side.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_watch.py [--rounds 10] [--tokens 32] [--every 1,DEFAULT] [--out DIR]

The engine, the tiny random Llama (hidden 256, 4 layers, fp32, tp 2, enforce_eager) and the driving are
bench/vllm_plugin.py's: one engine per variant, all up at once, one untimed warm-up generation each, then
`--rounds` rounds of one greedy generation of `--tokens` tokens per engine (a new prompt each round), the
engines' order reversed every other round, 1.5 s between two generations (vLLM's workers busy-poll for 1 s
after a step). Variants:
  off           no TPPROBE_CAPTURE_DIR: the plugin is loaded and does nothing (= not installed)
  watch N       TPPROBE_WATCH=N (TPPROBE_MAX_STEPS then defaults to 0: nothing captured besides)
Per variant: the median tokens/s of the rounds, its min..max, and the tokens/s over all rounds together
(total tokens / total seconds: at a large N a round may hold no checked forward, so the median alone would
hide the cost; the budget is judged on this one, against off's). The cost of one checked forward (ms) is
read from watch 1 against off; the budget line says whether the default N lies within 2 % of off.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from harness import alternate, write_json  # noqa: E402
from vllm_plugin import ENGINE, Engine, checkpoint, entry_point  # noqa: E402

from tpprobe.engines.watch import DEFAULT_EVERY  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--every", default=f"1,{DEFAULT_EVERY}", help="comma list of N to run beside off")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    everies = [int(x) for x in a.every.split(",") if x.strip()]
    variants = ["off"] + [f"watch {n}" for n in everies]
    t_all, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tpprobe-vllm-watch-") as tmp:
        tmp = Path(tmp)
        model = checkpoint(tmp / "model")
        script = tmp / "engine.py"
        script.write_text(ENGINE)
        site = entry_point(tmp / "site")
        print(f"vLLM CPU engine, tp 2, tiny Llama (hidden 256, 4 layers, fp32): {len(variants)} engines up at once, "
              f"{a.rounds} rounds of one {a.tokens}-token greedy generation each", flush=True)
        engines, caps = {}, {}
        try:
            for v, n in zip(variants, [0] + everies):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
                           VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe")
                for k in [k for k in env if k.startswith("TPPROBE_")]:
                    env.pop(k)
                if n:
                    caps[v] = tmp / f"watch-{n}"
                    env.update(TPPROBE_CAPTURE_DIR=str(caps[v]), TPPROBE_WATCH=str(n))
                engines[v] = Engine(tmp, script, model, env, v)
                engines[v].generate(1, a.tokens)        # warm-up
                print(f"  {v:>10}: engine up in {engines[v].start_s:.1f} s", flush=True)
            gens = {v: [] for v in variants}

            def timed(v: str) -> float:
                time.sleep(1.5)
                g = engines[v].generate(2 + len(gens[v]), a.tokens)
                gens[v].append(g)
                return g["gen_s"]

            times = alternate(variants, timed, iters=a.rounds, warmup=0)
        finally:
            for e in engines.values():
                e.close()
        summaries = {v: json.loads((c / "dp0-pp0" / "watch-rank-000.json").read_text())
                     for v, c in caps.items() if (c / "dp0-pp0" / "watch-rank-000.json").exists()}
    rate = {v: [a.tokens / t for t in ts] for v, ts in times.items()}
    med = {v: statistics.median(x) for v, x in rate.items()}
    overall = {v: a.tokens * len(ts) / sum(ts) for v, ts in times.items()}
    print(f"\n{'variant':>10} {'tok/s median':>13} {'min..max tok/s':>17} {'tok/s overall':>14} {'x off':>7}")
    for v in variants:
        print(f"{v:>10} {med[v]:13.1f} {min(rate[v]):8.1f}..{max(rate[v]):<8.1f} {overall[v]:14.1f} "
              f"{overall[v] / overall['off']:7.3f}")
    per_check_ms = (1 / overall["watch 1"] - 1 / overall["off"]) * 1e3 if "watch 1" in overall else None
    for v, s in summaries.items():
        print(f"  {v}: rank 0's summary: {s['checked']} forward(s) checked, {s['healthy']} healthy, "
              f"{s['failing']} failing, stopped: {s['stopped']}; ms per checked forward: "
              + ", ".join(f"{k} {1e3 * x / max(s['checked'], 1):.1f}" for k, x in (s.get("seconds") or {}).items()))
    same = len({json.dumps([g["tokens"] for g in gs]) for gs in gens.values()}) == 1
    d = f"watch {DEFAULT_EVERY}"
    verdict = ""
    if d in overall:
        loss = 1 - overall[d] / overall["off"]
        verdict = (f"default N={DEFAULT_EVERY}: {100 * loss:+.1f} % tokens/s against off (budget 2 %): "
                   f"{'HOLDS' if loss <= 0.02 else 'EXCEEDED'}; ")
    print(f"{verdict}one checked forward costs {per_check_ms:.1f} ms (watch 1 against off); same tokens in every "
          f"variant: {same}; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; {time.time() - t_all:.0f} s")
    if a.out:
        path = write_json(a.out, "vllm_watch.json", {
            "args": vars(a), "gen_s": times, "tok_s_median": med, "tok_s_overall": overall,
            "per_checked_forward_ms": per_check_ms, "summaries": summaries, "same_tokens": same,
            "loadavg": [load0[0], os.getloadavg()[0]]})
        print(f"wrote {path}")
    if not same:
        sys.exit("the variants generated different tokens: the watch changed the engine's output")
    bad = [v for v, s in summaries.items() if s["failing"] or s["stopped"]]
    if bad:
        sys.exit(f"the watch found something or stopped in a healthy engine: {bad}")


if __name__ == "__main__":
    main()
