"""gpt-fast's `tp.py` shape: a replicated `nn.Embedding` (no reduce), `TransformerBlock`s whose
`attention.wo` and `feed_forward.w2` are plain `nn.Linear` modules holding a shard, reduced in a
FORWARD HOOK through functional collectives (`torch.distributed._functional_collectives`), as
gpt-fast's `_apply_tp_linear` does.

Factories: `healthy`, `drop` (layer ZOO_LAYER's w2 gets no hook: its reduce never runs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tests.zoo.common import FFN, HIDDEN, LAYERS, VOCAB, Weights, cols, fault_layer, rows, target


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.weight


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.weight.requires_grad_(False)
    return lin


class Attention(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        self.wqkv = _linear(rows(w.randn(3 * FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx))
        self.wo = _linear(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx))

    def forward(self, x):
        q, k, v = self.wqkv(x).chunk(3, -1)
        return self.wo(torch.softmax(q @ k.t() / 8.0, -1) @ v)


class FeedForward(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        self.w1 = _linear(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx))
        self.w3 = _linear(rows(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx))
        self.w2 = _linear(cols(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), ctx))

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        self.attention = Attention(w, ctx)
        self.feed_forward = FeedForward(w, ctx)
        self.attention_norm = RMSNorm(HIDDEN)
        self.ffn_norm = RMSNorm(HIDDEN)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        w = Weights(ctx.seed)
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.tok_embeddings.weight.copy_(w.randn(VOCAB, HIDDEN))
        self.layers = nn.ModuleList(TransformerBlock(w, ctx) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _apply_tp(model: Transformer, drop=None):
    """gpt-fast: `lin.register_forward_hook(lambda _m, _i, out: funcol.all_reduce(out, "sum", group))`."""
    group = dist.group.WORLD
    for i, layer in enumerate(model.layers):
        layer.attention.wo.register_forward_hook(lambda _m, _i, out: funcol.all_reduce(out, "sum", group))
        if i != drop:
            layer.feed_forward.w2.register_forward_hook(lambda _m, _i, out: funcol.all_reduce(out, "sum", group))
    return model


def healthy(ctx):
    return target(_apply_tp(Transformer(ctx)), ctx, "zoo-gptfast")


def drop(ctx):
    return target(_apply_tp(Transformer(ctx), drop=fault_layer()), ctx, "zoo-gptfast")
