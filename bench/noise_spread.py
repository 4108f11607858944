"""Measure the healthy spread the noise model is calibrated on (docs/noise.md).

For capture folders written by `tpprobe probe --exchange full`, print per capture point the
norm-wise relative error ||a - b|| / ||b|| (whole tensor and worst token row) and the worst
element in ULP of the element's own magnitude, of every rank against rank 0 and, for the built-in
model, of rank 0 against the unsharded tp=1 reference computed in the same dtype.

    python bench/noise_spread.py DIR [DIR ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tpprobe.core.noise import measure   # the one noise model


def main(dirs):
    from safetensors.torch import load_file
    worst = {}
    for d in map(Path, dirs):
        rep = json.loads((d / "report.json").read_text())
        st = rep["settings"]
        dtype = getattr(torch, st["dtype"])
        ranks = [load_file(str(d / f"rank-{r:03d}.safetensors")) for r in range(st["world_size"])]
        refs = {}
        if st.get("model") == "builtin":
            from tpprobe.engines.builtin.model import BuiltinConfig, reference_streams
            cfg = BuiltinConfig(num_layers=st["num_layers"], hidden=st["hidden"], tokens=st["tokens"],
                                seed=st["seed"], dtype=dtype, **({"vocab": st["vocab"]} if "vocab" in st else {}))
            refs = reference_streams(cfg)
        for name in sorted(n for n in ranks[0] if n.endswith(".out") and not n.startswith("allreduce")):
            for r in range(1, len(ranks)):
                m = measure(ranks[r][name], ranks[0][name], dtype)
                key = (st["dtype"], "cross-rank", st.get("inject") and ",".join(st["inject"]) or "healthy")
                worst[key] = max(worst.get(key, (0, 0, 0)), (m["rel_norm"], m["row_rel_max"], m["ulp_max"]))
            if name in refs:
                m = measure(ranks[0][name], refs[name].to(ranks[0][name].dtype), dtype)
                key = (st["dtype"], f"tp1-vs-tp{st['world_size']}", "healthy")
                worst[key] = max(worst.get(key, (0, 0, 0)), (m["rel_norm"], m["row_rel_max"], m["ulp_max"]))
    print(f"{'dtype':9} {'comparison':12} {'run':14} {'rel_norm':>9} {'row_rel':>9} {'ulp_max':>8}")
    for (dt, cmp, run), (a, b, c) in sorted(worst.items()):
        print(f"{dt:9} {cmp:12} {run:14} {a:9.2e} {b:9.2e} {c:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
