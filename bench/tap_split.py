"""Which part of the Tap costs host time in an eager decode forward (diagnostic for issue 14).

    python bench/tap_split.py [--device cuda] [--hidden 7168] [--tokens 1] [--rounds 200]

World 1, the built-in model, variants alternated round by round, median and mean of --rounds (us):
  off         the bare forward
  audit       the collective audit alone (an Audit around the forward)
  nohook15    15 no-op pre/post hook pairs on the modules the Tap hooks (torch's slow call path alone)
  hooks       the Tap with audit=False (its hooks and their work)
  tap         the Tap as the probe installs it
  tap_embed   the Tap told where the embedding is (no discovery hooks on candidate modules)
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.hook_overhead import weights_on  # noqa: E402
from tpprobe.capture.audit import Audit  # noqa: E402
from tpprobe.capture.hooks import Tap, _plan  # noqa: E402
from tpprobe.model import BuiltinConfig, TPModel  # noqa: E402
from tpprobe.target import RankContext  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=2 * a.hidden, vocab=1024,
                        tokens=a.tokens, dtype=getattr(torch, a.dtype), layer_ids=[-1, 1, 3])
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="gloo")
    with torch.no_grad():
        model = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
    model.set_eagle3_layers_to_capture([-1, 1, 3])
    ids = torch.randint(0, 1024, (a.tokens,)).to(dev)
    plan = _plan(model, None, None)
    mods = [m for _, _, m, _ in plan.subs] + [s for _, _, _, subs in plan.subs for k, n, s in subs
                                              if k == "row" or n.endswith("0.input_layernorm")]
    mods += [m for _, m in plan.candidates]
    nop_pre, nop_post = (lambda m, a: None), (lambda m, a, o: None)

    def off():
        model(ids)

    def audit():
        with Audit(lambda t: ("m", None, "x", None)):
            model(ids)

    def nohook():
        hs = [m.register_forward_pre_hook(nop_pre) for m in mods] + [m.register_forward_hook(nop_post) for m in mods]
        model(ids)
        for h in hs:
            h.remove()

    def hooks():
        with Tap(model, keep=lambda n: False, keep_allreduce_tensors=False, audit=False):
            model(ids)

    def tap():
        with Tap(model, keep=lambda n: False, keep_allreduce_tensors=False):
            model(ids)

    def tap_embed():
        with Tap(model, keep=lambda n: False, keep_allreduce_tensors=False, embed="embed_tokens"):
            model(ids)

    V = {"off": off, "audit": audit, f"nohook{len(mods)}": nohook, "hooks": hooks, "tap": tap, "tap_embed": tap_embed}
    T = {v: [] for v in V}
    with torch.no_grad():
        for i in range(a.rounds + 5):
            for v, f in (list(V.items()) if i % 2 else list(V.items())[::-1]):
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                if i >= 5:
                    T[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(x) * 1e6 for v, x in T.items()}
    mean = {v: statistics.mean(x) * 1e6 for v, x in T.items()}
    print(f"tap split: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, hidden {a.hidden}, "
          f"{a.tokens} token(s), {a.rounds} rounds: us, + over off (median / mean)")
    for v in V:
        print(f"  {v:<10} {med[v]:>9.1f}  +{med[v] - med['off']:>7.1f}   mean +{mean[v] - mean['off']:>7.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
