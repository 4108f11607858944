"""The floor of fingerprint mode in eager decode: its device calls alone, with none of the Tap's host work.

    python bench/fp_floor.py [--tokens 1] [--rounds 60] [--out DIR]

The bare decode forward of the built-in model with the 9 all-reduces of a tp-2 model over a world-1
NCCL group (bench/decode_setup.py), no Tap. Bare forward hooks make, where the Tap makes them, the device
calls `--exchange fingerprint` makes in one checked forward, and nothing else:
  off          the bare forward
  coll18       a fingerprint launch (the C Taker) of each all-reduce's input, before it, and of its output,
               after it: 18 launches
  floor        coll18, plus what the capture points cost: hidden + residual at each decoder layer's end (4 sums),
               a copy of the two points kept and not already copies (the embedding's output, layer 0's input
               norm), the 6 points' launches queued for the read, and the read itself (the launches, the
               combine, the one device-to-host copy), timed
Each forward is timed from a synchronised start to the device done (floor: and its fingerprints on the host);
variants alternate round by round; printed: each variant's median, and the median and quartiles of each round's
own ratio to off (harness.paired). Whatever the Tap does on the host (finding the places, the records, the
audit's doors, the attribution, enter and exit) comes on top of `floor`. Writes fp_floor.json.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.decode_setup import add_model_args, decode_model  # noqa: E402
from bench.harness import alternate, paired, write_json  # noqa: E402
from tpprobe.fingerprint.reference import Deferred  # noqa: E402

VARIANTS = ["off", "coll18", "floor"]


def main():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    a.collectives, a.device = True, "cuda"
    os.environ["TPPROBE_NATIVE"] = "1"
    model, ids, _, dev, sync = decode_model(a, torch.bfloat16)
    state = {"mode": "off", "fp": None, "tk": None, "later": None, "kept": []}

    def before_reduce(mod, args, out):          # runs before decode_setup's all-reduce hook
        if state["mode"] != "off":
            state["tk"](out)

    def after_reduce(mod, args, out):
        if state["mode"] != "off":
            state["tk"](out)

    def embed_point(mod, args, out):             # the embedding's output, kept: a copy, read later
        if state["mode"] == "floor":
            c = out.clone()
            state["kept"].append(c)
            state["later"](c)

    def norm_point(mod, args, out):              # layer 0's input norm, kept
        if state["mode"] == "floor":
            c = out[0].clone() if isinstance(out, tuple) else out.clone()
            state["kept"].append(c)
            state["later"](c)

    def layer_point(mod, args, out):             # the stream: hidden + residual, the Tap's own, read later
        if state["mode"] == "floor":
            s = out[0] + out[1]
            state["kept"].append(s)
            state["later"](s)

    reducing = [model.embed_tokens] + [x for layer in model.layers for x in (layer.self_attn.o_proj,
                                                                             layer.mlp.down_proj)]
    for m in reducing:
        m.register_forward_hook(before_reduce, prepend=True)
        m.register_forward_hook(after_reduce)
    model.embed_tokens.register_forward_hook(embed_point)
    model.layers[0].input_layernorm.register_forward_hook(norm_point)
    for layer in model.layers:
        layer.register_forward_hook(layer_point)

    warm = Deferred(0x7470, 32)            # the C module is built at the first GPU batch: one call through Python
    warm(torch.ones(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16))
    warm.resolve()

    def run(v):
        fp = Deferred(0x7470, 32)
        tk = fp.fast()
        state.update(mode=v, fp=fp, tk=tk, later=tk.later, kept=[])
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids)
        if v == "floor":
            fp.resolve()
        sync()
        t = time.perf_counter() - t0
        state["mode"] = "off"
        if v == "coll18":
            fp.resolve()                       # read outside the timing: coll18 prices the launches alone
        return t

    times = alternate(VARIANTS, run, a.rounds, warmup=3)
    med = {v: statistics.median(ts) * 1e6 for v, ts in times.items()}
    pr = paired(times)
    gpu = torch.cuda.get_device_name(dev)
    print(f"fp_floor: {gpu}, torch {torch.__version__}, hidden {a.hidden}, {a.num_layers} layers, {a.tokens} token(s), "
          f"9 all-reduces (world 1), {a.rounds} rounds")
    print(f"{'variant':<8}{'median us':>11}{'x off (paired median)':>24}{'[q1, q3]':>18}")
    for v in VARIANTS:
        q1, q2, q3 = pr.get(v, (1.0, 1.0, 1.0))
        print(f"{v:<8}{med[v]:>11.0f}{q2:>24.3f}{f'[{q1:.3f}, {q3:.3f}]':>18}")
    write_json(a.out, "fp_floor.json", {"bench": "fp_floor", "gpu": gpu, "torch": torch.__version__,
                                        "tokens": a.tokens, "rounds": a.rounds, "median_us": med,
                                        "paired": {v: list(q) for v, q in pr.items()}})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
