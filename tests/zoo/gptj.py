"""GPT-J: parallel attention + MLP, one all-reduce per block issued by the block itself.

Nothing here is named like SGLang: `Embedder` (vocab-parallel, reduces inside), `Block`, the list
`transformer.h`, no `*RowParallel*` module. Factories: `healthy`, `drop` (layer ZOO_LAYER skips
its reduce), `nudge` (rank ZOO_RANK scales its stream by ZOO_SCALE from layer ZOO_LAYER on).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from tests.zoo.common import FFN, HIDDEN, LAYERS, VOCAB, Weights, cols, fault_layer, fault_rank, rows, target


class Embedder(nn.Module):
    def __init__(self, w: Weights, ctx):
        super().__init__()
        full = w.randn(VOCAB, HIDDEN)
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.wte = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)

    def forward(self, input_ids):
        mask = (input_ids >= self.lo) & (input_ids < self.hi)
        out = self.wte[(input_ids - self.lo).clamp(0, self.hi - self.lo - 1)] * mask.unsqueeze(-1).to(self.wte.dtype)
        dist.all_reduce(out)
        return out


class Block(nn.Module):
    def __init__(self, w: Weights, ctx, reduce: bool = True, scale: float = 1.0):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        with torch.no_grad():
            self.ln.weight.copy_(1 + w.randn(HIDDEN, scale=0.1))
        self.qv = nn.Parameter(rows(w.randn(2 * FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx), requires_grad=False)
        self.out = nn.Parameter(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx), requires_grad=False)
        self.fc_in = nn.Parameter(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx), requires_grad=False)
        self.fc_out = nn.Parameter(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx), requires_grad=False)
        self.reduce, self.scale = reduce, scale

    def forward(self, x):
        h = self.ln(x)
        q, v = (h @ self.qv.t()).chunk(2, -1)
        attn = (torch.softmax(q @ q.t() / 8.0, -1) @ v) @ self.out.t()
        mlp = torch.nn.functional.gelu(h @ self.fc_in.t()) @ self.fc_out.t()
        y = attn + mlp                 # GPT-J: both partial sums, reduced together, once
        if self.reduce:
            y = self.all_reduce(y)
        return (x + y) * self.scale

    def all_reduce(self, y):
        dist.all_reduce(y)
        return y


class Transformer(nn.Module):
    def __init__(self, ctx, drop=None, nudge=None):
        super().__init__()
        w = Weights(ctx.seed)
        self.wte = Embedder(w, ctx)
        self.h = nn.ModuleList(Block(w, ctx, reduce=i != drop, scale=nudge if nudge and i == fault_layer() else 1.0)
                               for i in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for b in self.h:
            x = b(x)
        return self.ln_f(x)


class GPTJ(nn.Module):
    def __init__(self, ctx, **kw):
        super().__init__()
        self.transformer = Transformer(ctx, **kw)

    def forward(self, input_ids):
        return self.transformer(input_ids)


def healthy(ctx):
    return target(GPTJ(ctx), ctx, "zoo-gptj")


def drop(ctx):
    return target(GPTJ(ctx, drop=fault_layer()), ctx, "zoo-gptj")


def nudge(ctx):
    scale = float(os.environ.get("ZOO_SCALE", "1.02")) if ctx.rank == fault_rank() else None
    return target(GPTJ(ctx, nudge=scale), ctx, "zoo-gptj")
