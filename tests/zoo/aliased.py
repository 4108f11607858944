"""A reduce bound by an ALIASED import, on a 2-D [tokens, hidden] stream: kept in the zoo because it is
a shape none of the real TP libraries has (tests/libs/test_tp_libs.py probes megatron-core's own GPTModel,
transformers' TP and torch's DTensor TP for real): each of them reaches `torch.distributed` through the
module attribute or functional collectives, and holds the stream as [b, s, h] or [s, b, h].

Here the reduce is `from torch.distributed import all_reduce as ar`, bound at import time, before any
probe could patch `torch.distributed.all_reduce` (the audit must see it below Python); the stream has
no batch dim; the names are the legacy Megatron-LM ones megatron-core no longer has
(`VocabParallelEmbedding(input_, position_ids)`, `encoder.layers` of `ParallelTransformerLayer`,
`RowParallelLinear(skip_bias_add=True)` returning (output, bias) with the replicated bias added after
the reduce), as forks of the old Megatron-LM still write them. A stale row-parallel bias is tested on
the real megatron-core (examples/megatron_gpt.py:build_stale_bias), not here.

Factories: `healthy`, `drop` (layer ZOO_LAYER's dense_4h_to_h skips its reduce).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed import all_reduce as ar

from tests.zoo.common import FFN, HIDDEN, LAYERS, TOKENS, VOCAB, Weights, cols, fault_layer, rows, target


class VocabParallelEmbedding(nn.Module):
    def __init__(self, w: Weights, ctx):
        super().__init__()
        full = w.randn(VOCAB, HIDDEN)
        per = VOCAB // ctx.world_size
        self.vocab_start_index, self.vocab_end_index = ctx.rank * per, (ctx.rank + 1) * per
        self.weight = nn.Parameter(full[self.vocab_start_index:self.vocab_end_index].clone(), requires_grad=False)
        self.position_embeddings = nn.Parameter(w.randn(TOKENS, HIDDEN, scale=0.1), requires_grad=False)

    def forward(self, input_, position_ids):
        mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked = (input_ - self.vocab_start_index).masked_fill(mask, 0)
        out = nn.functional.embedding(masked, self.weight).masked_fill(mask.unsqueeze(-1), 0.0)
        ar(out)
        return out + self.position_embeddings[position_ids]


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: torch.Tensor, ctx):
        super().__init__()
        self.weight = nn.Parameter(rows(full, ctx), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.t()


class RowParallelLinear(nn.Module):
    def __init__(self, full: torch.Tensor, bias: torch.Tensor, ctx, reduce: bool = True):
        super().__init__()
        self.weight = nn.Parameter(cols(full, ctx), requires_grad=False)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)     # replicated
        self.skip_bias_add, self.reduce = True, reduce

    def forward(self, x):
        out = x @ self.weight.t()
        if self.reduce:
            ar(out)
        return out, self.bias


class ParallelMLP(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(w.randn(FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx)
        self.dense_4h_to_h = RowParallelLinear(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), w.randn(HIDDEN, scale=0.1),
                                               ctx, reduce)

    def forward(self, x):
        return self.dense_4h_to_h(torch.nn.functional.gelu(self.dense_h_to_4h(x)))


class ParallelAttention(nn.Module):
    def __init__(self, w, ctx):
        super().__init__()
        self.query_key_value = ColumnParallelLinear(w.randn(3 * FFN, HIDDEN, scale=HIDDEN ** -0.5), ctx)
        self.dense = RowParallelLinear(w.randn(HIDDEN, FFN, scale=FFN ** -0.5), w.randn(HIDDEN, scale=0.1), ctx)

    def forward(self, x, attention_mask):
        q, k, v = self.query_key_value(x).chunk(3, -1)
        s = (q @ k.t()) / 8.0 + attention_mask
        return self.dense(torch.softmax(s, -1) @ v)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, w, ctx, reduce=True):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = ParallelAttention(w, ctx)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = ParallelMLP(w, ctx, reduce)

    def forward(self, hidden_states, attention_mask):
        out, bias = self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        x = hidden_states + out + bias
        out, bias = self.mlp(self.post_attention_layernorm(x))
        return x + out + bias


class ParallelTransformer(nn.Module):
    def __init__(self, w, ctx, drop=None):
        super().__init__()
        self.layers = nn.ModuleList(ParallelTransformerLayer(w, ctx, reduce=i != drop) for i in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.final_layernorm(hidden_states)


class GPTModel(nn.Module):
    def __init__(self, ctx, drop=None):
        super().__init__()
        w = Weights(ctx.seed)
        self.embedding = VocabParallelEmbedding(w, ctx)
        self.encoder = ParallelTransformer(w, ctx, drop)

    def forward(self, input_ids, position_ids, attention_mask):
        return self.encoder(self.embedding(input_ids, position_ids), attention_mask)


def _call(model, ids):
    pos = torch.arange(ids.numel(), device=ids.device)
    mask = torch.triu(torch.full((ids.numel(), ids.numel()), -1e4,
                                 device=ids.device), 1).to(model.embedding.weight.dtype)
    return model(ids, pos, mask)


def healthy(ctx):
    return target(GPTModel(ctx), ctx, "zoo-aliased", call=_call)


def drop(ctx):
    return target(GPTModel(ctx, drop=fault_layer()), ctx, "zoo-aliased", call=_call)

