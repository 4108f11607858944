"""Sequence-parallel TP: each row-parallel output is reduce-scattered over the token dimension
(`dist.reduce_scatter_tensor`) and all-gathered back (`dist.all_gather_into_tensor`): a
reduce-scatter + all-gather is the all-reduce, split in two.

Factories: `healthy`, `drop` (layer ZOO_LAYER takes its own token chunk of the partial sum instead
of the reduce-scatter; the all-gather still runs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.zoo.common import FFN, HIDDEN, LAYERS, VOCAB, Weights, cols, fault_layer, rows, target


class TokenEmbedding(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        full = w.randn(VOCAB, HIDDEN)
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.table = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)

    def forward(self, tokens):
        keep = ((tokens >= self.lo) & (tokens < self.hi)).unsqueeze(-1)
        out = torch.where(keep, self.table[(tokens - self.lo).clamp(0, self.hi - self.lo - 1)], 0.0)
        dist.all_reduce(out)
        return out


class SPBlock(nn.Module):
    def __init__(self, w, ctx, drop=False):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Parameter(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx), requires_grad=False)
        self.down = nn.Parameter(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx), requires_grad=False)
        self.world, self.rank, self.drop = ctx.world_size, ctx.rank, drop

    def forward(self, x):
        partial = torch.relu(self.norm(x) @ self.up.t()) @ self.down.t()
        chunk = torch.empty(partial.shape[0] // self.world, partial.shape[1],
                            dtype=partial.dtype, device=partial.device)
        if self.drop:
            chunk.copy_(partial.chunk(self.world, 0)[self.rank])
        else:
            dist.reduce_scatter_tensor(chunk, partial)
        full = torch.empty_like(partial)
        dist.all_gather_into_tensor(full, chunk)
        return x + full


class SPModel(nn.Module):
    def __init__(self, ctx, drop=None):
        super().__init__()
        w = Weights(ctx.seed)
        self.embed = TokenEmbedding(w, ctx)
        self.blocks = nn.ModuleList(SPBlock(w, ctx, drop=i == drop) for i in range(LAYERS))

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return x


def healthy(ctx):
    return target(SPModel(ctx), ctx, "zoo-seqpar")


def drop(ctx):
    return target(SPModel(ctx, drop=fault_layer()), ctx, "zoo-seqpar")
