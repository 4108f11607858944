"""The plugin's cost with a real EAGLE-3 drafter in vLLM's CPU engine: tokens/s with and without it, side by side.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_draft.py [--rounds 8] [--tokens 16] [--out DIR]

vLLM's engine (`vllm.LLM`, tp 2, enforce_eager, the V1 model runner) serves the planted target with its one-slot
EAGLE-3 draft (tpprobe.engines.vllm.planted; `num_speculative_tokens` 1, acceptance 1.00) in two variants, one
engine each, all up at once:
  off         no TPPROBE_CAPTURE_DIR: the plugin is loaded and does nothing (= not installed)
  every step  the plugin captures every forward AND what the drafter receives at every step (its slots matched
              against the forward's streams, per request, written with rank 0's tensors), and counts vLLM's
              acceptance (TPPROBE_MAX_STEPS=100000, TPPROBE_FORWARD_MODES=all)
  past its steps  the default budget (TPPROBE_MAX_STEPS=1, extend): the warm-up's first prefill is captured;
              every timed step runs past it, with vLLM's acceptance still counted (acceptance.json)
Each engine serves one untimed warm-up generation; then `--rounds` rounds, each a greedy generation of `--tokens`
tokens per engine (a new prompt each round), the order reversed every other round and 1.5 s between two
generations (bench/vllm_plugin.py's harness). Printed: median tokens/s, min..max, the paired ratio to `off`, the
bytes of the drafter's files per step, vLLM's acceptance per variant (its counters: must be equal), same tokens.
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
from vllm_plugin import Engine, entry_point  # noqa: E402

ENGINE = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=256, enforce_eager=True, distributed_executor_backend="mp", disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": sys.argv[2], "num_speculative_tokens": 1})
    print("READY " + json.dumps({"start_s": time.time() - t0}), flush=True)
    for line in sys.stdin:          # one generation per line: {"prompt": ids, "tokens": n}
        cmd = json.loads(line)
        sp = SamplingParams(max_tokens=cmd["tokens"], temperature=0, detokenize=False, ignore_eos=True)
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)
        dt = time.perf_counter() - t1
        m = {x.name.split(":")[1]: (list(x.values) if hasattr(x, "values") else x.value) for x in llm.get_metrics()
             if "spec_decode" in x.name}
        print("GEN " + json.dumps({"gen_s": dt, "tokens": list(out[0].outputs[0].token_ids), "metrics": m}),
              flush=True)
'''

VARIANTS = {"off": None, "every step": {"TPPROBE_MAX_STEPS": "100000", "TPPROBE_FORWARD_MODES": "all"},
            "past its steps": {"TPPROBE_MAX_STEPS": "1", "TPPROBE_FORWARD_MODES": "extend"}}


class DraftEngine(Engine):
    def __init__(self, tmp, script, target, draft, env, name):
        import subprocess
        self.log = open(tmp / f"{name.replace(' ', '-')}.log", "w")
        self.p = subprocess.Popen([sys.executable, str(script), str(target), str(draft)], env=env, cwd=tmp,
                                  text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.name = name
        self.start_s = self.read("READY ")["start_s"]

    def run(self, prompt: list, tokens: int) -> dict:
        self.p.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
        self.p.stdin.flush()
        return self.read("GEN ")


def main():
    from tpprobe.engines.vllm.planted import build_draft, build_target, next_token

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    t_all = time.time()
    f = next_token()

    def prompt(start: int) -> list:
        out = [start]
        while len(out) < 8:
            out.append(f[out[-1]])
        return out

    with tempfile.TemporaryDirectory(prefix="tpprobe-vllm-draft-bench-") as tmp:
        tmp = Path(tmp)
        target = build_target(tmp / "target")
        draft = build_draft(tmp / "draft", [1, 2, 3], read_slot=1)
        script = tmp / "engine.py"
        script.write_text(ENGINE)
        site = entry_point(tmp / "site")
        print(f"vLLM CPU engine, tp 2, planted Llama (hidden 256, 4 layers, fp32) + EAGLE-3 draft (1 speculative "
              f"token): {len(VARIANTS)} engines up at once, {a.rounds} rounds of one {a.tokens}-token generation",
              flush=True)
        engines, caps = {}, {}
        try:
            for v, extra in VARIANTS.items():
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
                           VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe")
                env.pop("TPPROBE_CAPTURE_DIR", None)
                if extra is not None:
                    caps[v] = tmp / f"capture-{v.replace(' ', '-')}"
                    env.update(extra, TPPROBE_CAPTURE_DIR=str(caps[v]))
                engines[v] = DraftEngine(tmp, script, target, draft, env, v)
                engines[v].run(prompt(1), a.tokens)
                print(f"  {v:>15}: engine up in {engines[v].start_s:.1f} s", flush=True)
            gens = {v: [] for v in VARIANTS}

            def timed(v: str) -> float:
                time.sleep(1.5)
                g = engines[v].run(prompt(2 + len(gens[v])), a.tokens)
                gens[v].append(g)
                return g["gen_s"]

            times = alternate(list(VARIANTS), timed, iters=a.rounds, warmup=0)
        finally:
            for e in engines.values():
                e.close()
        dsteps = sorted(caps["every step"].rglob("drafter"))
        per_step = [sum(f.stat().st_size for f in d.iterdir()) for d in dsteps]
    toks = {v: [g["tokens"] for g in gs] for v, gs in gens.items()}
    acc = {v: gs[-1]["metrics"] for v, gs in gens.items()}
    rate = {v: [a.tokens / t for t in ts] for v, ts in times.items()}
    med = {v: statistics.median(x) for v, x in rate.items()}
    ratio = {v: statistics.median(t_off / t for t, t_off in zip(times[v], times["off"])) for v in VARIANTS}
    print(f"\n{'variant':>15} {'tok/s median':>13} {'min..max tok/s':>17} {'x off (paired)':>15}  vLLM acceptance")
    for v in VARIANTS:
        m = acc[v]
        r = m["spec_decode_num_accepted_tokens"] / max(1, m["spec_decode_num_draft_tokens"])
        print(f"{v:>15} {med[v]:13.1f} {min(rate[v]):8.1f}..{max(rate[v]):<8.1f} {ratio[v]:15.3f}  "
              f"{m['spec_decode_num_accepted_tokens']}/{m['spec_decode_num_draft_tokens']} = {r:.2f}")
    same = len({json.dumps(t) for t in toks.values()}) == 1
    same_acc = len({json.dumps(m, sort_keys=True) for m in acc.values()}) == 1
    print(f"drafter files per captured step (both ranks' JSON + rank 0's tensors): median "
          f"{statistics.median(per_step) if per_step else 0:.0f} B over {len(per_step)} steps; same tokens: {same}; "
          f"same acceptance counters: {same_acc}; {time.time() - t_all:.0f} s in all")
    if a.out:
        path = write_json(a.out, "vllm_draft.json", {
            "args": vars(a), "gen_s": times, "tok_s_median": med, "ratio_to_off_paired": ratio, "acceptance": acc,
            "drafter_bytes_per_step": per_step, "same_tokens": same, "same_acceptance": same_acc})
        print(f"wrote {path}")
    if not same or not same_acc:
        sys.exit("the variants differ: the plugin changed the engine's output")


if __name__ == "__main__":
    main()
