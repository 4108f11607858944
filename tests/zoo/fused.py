"""SGLang-like `(hidden_states, residual)` layers with a FUSED residual-add + RMSNorm after the
reduce: `fused_add_rmsnorm(x, residual, w)` returns (normed, x + residual) as the fused kernels
do; each layer's first step is the fused add of the previous layer's (reduced) output.

Factories: `healthy`, `drop` (layer ZOO_LAYER's output projection is never reduced).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.zoo.common import FFN, HIDDEN, LAYERS, VOCAB, Weights, cols, fault_layer, rows, target


def fused_add_rmsnorm(x, residual, weight, eps=1e-6):
    s = x if residual is None else x + residual
    n = s * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps).to(s.dtype) * weight
    return n, s


class Mixer(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.up = nn.Parameter(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx), requires_grad=False)
        self.down = nn.Parameter(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx), requires_grad=False)
        self.reduce = reduce

    def forward(self, x):
        y = torch.tanh(x @ self.up.t()) @ self.down.t()
        if self.reduce:
            dist.all_reduce(y)
        return y


class FusedLayer(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.norm_weight = nn.Parameter(1 + w.randn(HIDDEN, scale=0.1), requires_grad=False)
        self.mixer = Mixer(w, ctx, reduce)

    def forward(self, hidden_states, residual):
        h, residual = fused_add_rmsnorm(hidden_states, residual, self.norm_weight)
        return self.mixer(h), residual


class Embed(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        full = w.randn(VOCAB, HIDDEN)
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.weight = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)

    def forward(self, ids):
        out = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        out = out * ((ids >= self.lo) & (ids < self.hi)).unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out)
        return out


class FusedModel(nn.Module):
    def __init__(self, ctx, drop=None):
        super().__init__()
        w = Weights(ctx.seed)
        self.emb = Embed(w, ctx)
        self.decoder = nn.ModuleList(FusedLayer(w, ctx, reduce=i != drop) for i in range(LAYERS))

    def forward(self, ids):
        h, r = self.emb(ids), None
        for layer in self.decoder:
            h, r = layer(h, r)
        return h + r


def healthy(ctx):
    return target(FusedModel(ctx), ctx, "zoo-fused")


def drop(ctx):
    return target(FusedModel(ctx, drop=fault_layer()), ctx, "zoo-fused")
