"""Random faults outside the catalogue for the full-vs-fingerprint sweep (tests/ranks/test_noise_sweep.py):
the GPT-J zoo model with rank ZOO_RANK's stream changed at the output of layer ZOO_LAYER.

ZOO_FAULT (seeded by ZOO_SEED):
  scale:R          the whole stream scaled by 1 + R (a systematic drift, relative error R)
  noise:R          plus random noise of norm R × the stream's norm (relative error R)
  tokens:R:N       the first N tokens' rows scaled by 1 + R
  element:R        one element (seeded position) scaled by 1 + R
  nan              one element set to NaN
"""
from __future__ import annotations

import os

import torch

from tests.zoo import gptj
from tests.zoo.common import fault_layer, fault_rank, target


def _fault(spec: str, seed: int):
    kind, *args = spec.split(":")
    g = torch.Generator().manual_seed(seed)

    def apply(module, inputs, out):
        x = out.float()
        if kind == "scale":
            y = x * (1 + float(args[0]))
        elif kind == "noise":
            n = torch.randn(x.shape, generator=g)
            y = x + n * (float(args[0]) * x.norm() / n.norm())
        elif kind == "tokens":
            y = x.clone()
            y[: int(args[1])] *= 1 + float(args[0])
        elif kind == "element":
            y = x.clone()
            i = int(torch.randint(0, x.numel(), (1,), generator=g))
            y.view(-1)[i] *= 1 + float(args[0])
        elif kind == "nan":
            y = x.clone()
            y.view(-1)[int(torch.randint(0, x.numel(), (1,), generator=g))] = float("nan")
        else:
            raise ValueError(spec)
        return y.to(out.dtype)
    return apply


def sweep(ctx):
    t = target(gptj.GPTJ(ctx), ctx, "zoo-gptj")
    if ctx.rank == fault_rank():
        t.model.transformer.h[fault_layer()].register_forward_hook(
            _fault(os.environ["ZOO_FAULT"], int(os.environ.get("ZOO_SEED", "0"))))
    return t
