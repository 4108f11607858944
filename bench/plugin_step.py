"""The SGLang plugin's cost per step on CPU: time and bytes per captured forward.

    PYTHONPATH=. python bench/plugin_step.py [--tokens 256] [--rounds 7] [--out FILE.json]

Two gloo ranks (tp 2) run SGLang's LlamaForCausalLM (the tiny config of tpprobe.engines.sglang.tiny, real
SGLang classes, loaded through load_plugins()) and alternate, forward by forward, three settings
of the live plugin (the environment is read per forward, the same on both ranks): `off` (no
capture dir: the plugin passes through), `fingerprint` (the default: every point a fingerprint,
nothing kept) and `keep-all` (TPPROBE_KEEP=*: every point kept whole, the old behaviour). Per
setting: the median forward time (what the server sees, file writing included), the bytes written
per step and rank, and the tensor bytes the plugin held (kept) per step.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def worker(ctx, tokens, rounds, root):
    import torch

    from tpprobe.engines.sglang import cpu_mode
    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    os.environ["TPPROBE_CAPTURE_DIR"] = root
    load_plugins()
    from tpprobe.engines.sglang.tiny import build_target

    t = build_target(ctx, "llama", 4, tokens, 0, torch.float32, [0, 1])
    settings = {"off": None, "fingerprint": "", "keep-all": "*"}
    times = {k: [] for k in settings}
    t.forward()                                      # warm-up (captured: step 0)
    for r in range(rounds):
        for name, keep in settings.items():
            if keep is None:
                os.environ.pop("TPPROBE_CAPTURE_DIR", None)
            else:
                os.environ["TPPROBE_CAPTURE_DIR"] = os.path.join(root, name)
                os.environ["TPPROBE_KEEP"] = keep
            torch.distributed.barrier()
            t0 = time.perf_counter()
            t.forward()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from pathlib import Path

    from helpers.sglang_ranks import run_ranks
    with tempfile.TemporaryDirectory() as root:
        env = {"SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "1000", "TPPROBE_FORWARD_MODES": "all",
               "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench"), os.environ.get("PYTHONPATH", "")])}
        res = run_ranks("plugin_step:worker", 2, dict(tokens=a.tokens, rounds=a.rounds, root=root), env=env,
                        timeout=600)
        per = {}
        for name in ("fingerprint", "keep-all"):
            steps = sorted(Path(root, name).glob("dp*-pp*/step-*"))
            files = [sum(f.stat().st_size for f in s.glob("rank-000.*")) for s in steps]
            metas = [json.loads((s / "rank-000.json").read_text()) for s in steps]
            per[name] = {"steps": len(steps), "bytes_written_per_step_rank0": statistics.median(files),
                         "kept_tensor_bytes_per_step": statistics.median(m["kept_bytes"] for m in metas),
                         "record_s": statistics.median(m["timings"]["record_s"] for m in metas)}
    off = res[0]["off"]
    print(f"SGLang plugin per step, tiny LlamaForCausalLM (hidden 64, 4 layers), tp 2 gloo, {a.tokens} tokens, "
          f"median of {a.rounds} (rank 0)")
    print(f"{'setting':>12} {'forward ms':>10} {'x off':>6} {'written B':>10} {'kept B':>8} {'record ms':>9}")
    print(f"{'off':>12} {off * 1e3:10.2f} {1.0:6.2f} {'-':>10} {'-':>8} {'-':>9}")
    for name, v in per.items():
        print(f"{name:>12} {res[0][name] * 1e3:10.2f} {res[0][name] / off:6.2f} "
              f"{v['bytes_written_per_step_rank0']:10.0f} {v['kept_tensor_bytes_per_step']:8.0f} "
              f"{v['record_s'] * 1e3:9.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "forward_s": res, "per_setting": per}, f, indent=1)


if __name__ == "__main__":
    main()
