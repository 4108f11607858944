"""MoE with a replicated router: every rank holds the whole `router` (it must pick the same experts
on every rank) and a TP shard of every expert; the experts' summed output is reduced once per block.

Factories: `healthy`, `drop` (layer ZOO_LAYER's MoE output is never reduced), `stale_router`
(rank ZOO_RANK holds a stale copy of layer ZOO_LAYER's router weight).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.zoo.common import FFN, HIDDEN, LAYERS, VOCAB, Weights, cols, fault_layer, fault_rank, rows, target

EXPERTS, TOPK = 4, 2


class Expert(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        self.w_in = nn.Parameter(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx), requires_grad=False)
        self.w_out = nn.Parameter(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.silu(x @ self.w_in.t()) @ self.w_out.t()


class SparseMoE(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(w.randn(EXPERTS, HIDDEN))
        self.router.weight.requires_grad_(False)
        self.experts = nn.ModuleList(Expert(w, ctx) for _ in range(EXPERTS))
        self.reduce = reduce

    def forward(self, x):
        p = torch.softmax(self.router(x).float(), -1)
        top, idx = p.topk(TOPK, -1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            wgt = (top * (idx == e)).sum(-1, keepdim=True).to(x.dtype)
            out = out + wgt * ex(x)
        if self.reduce:
            dist.all_reduce(out)
        return out


class MoELayer(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = SparseMoE(w, ctx, reduce)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class Embedding(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        full = w.randn(VOCAB, HIDDEN)
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.shard = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)

    def forward(self, ids):
        inside = ((ids >= self.lo) & (ids < self.hi)).unsqueeze(-1).to(self.shard.dtype)
        out = self.shard[(ids - self.lo).clamp(0, self.hi - self.lo - 1)] * inside
        dist.all_reduce(out)
        return out


class MoEModel(nn.Module):
    def __init__(self, ctx, drop=None):
        super().__init__()
        w = Weights(ctx.seed)
        self.tok = Embedding(w, ctx)
        self.stack = nn.ModuleList(MoELayer(w, ctx, reduce=i != drop) for i in range(LAYERS))

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.stack:
            x = layer(x)
        return x


def healthy(ctx):
    return target(MoEModel(ctx), ctx, "zoo-moe")


def drop(ctx):
    return target(MoEModel(ctx, drop=fault_layer()), ctx, "zoo-moe")


def stale_router(ctx):
    t = target(MoEModel(ctx), ctx, "zoo-moe")
    if ctx.rank == fault_rank():
        with torch.no_grad():
            t.model.stack[fault_layer()].moe.router.weight.mul_(1.5)
    return t
