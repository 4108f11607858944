"""Shared pieces of the zoo: sizes, the shard helpers and the factory plumbing."""
from __future__ import annotations

import os

import torch

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, FFN, LAYERS, TOKENS = 96, 32, 64, 4, 8


def dtype() -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        os.environ.get("ZOO_DTYPE", "float32")]


def fault_layer() -> int:
    return int(os.environ.get("ZOO_LAYER", "2"))


def fault_rank() -> int:
    return int(os.environ.get("ZOO_RANK", "1"))


class Weights:
    """The same full weights on every rank (one seed), sharded the way a TP loader would."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * scale


def rows(w: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """Column-parallel: this rank's slice of the output features (dim 0 of a Linear weight)."""
    return w.chunk(ctx.world_size, 0)[ctx.rank].clone()


def cols(w: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """Row-parallel: this rank's slice of the input features (dim 1 of a Linear weight)."""
    return w.chunk(ctx.world_size, 1)[ctx.rank].clone()


def ids_for(ctx: RankContext) -> torch.Tensor:
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)


def target(model, ctx: RankContext, arch: str, call=None, **kw) -> ProbeTarget:
    model = model.to(device=ctx.device, dtype=dtype()).eval()
    ids = ids_for(ctx)
    fwd = (lambda: call(model, ids)) if call is not None else (lambda: model(ids))
    return ProbeTarget(model=model, forward=fwd, input_ids=ids, num_layers=LAYERS, hidden_size=HIDDEN,
                       dtype=dtype(), arch=arch, **kw)
