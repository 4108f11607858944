"""Probe your own model: `tpprobe probe --model examples.my_model:build --nproc 2`.

A factory receives the rank's `RankContext` (rank, world size, device, backend, process group;
torch.distributed is already initialised) and returns a `ProbeTarget`: the model, a callable that
runs one forward, the input ids (identical on every rank) and a few facts. tpprobe finds the
embedding (the module that takes the input ids and returns [tokens, hidden]) and the decoder
layers (the longest nn.ModuleList) from the model's structure (override: --embed / --layer-list),
audits every reduce at the c10d level, and checks across ranks.

This example is a two-layer tensor-parallel MLP stack written from scratch, the shape most TP
models share: a vocab-parallel embedding, then layers whose row-parallel output is all-reduced.
"""
import torch
import torch.distributed as dist
from torch import nn

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, FFN, LAYERS, TOKENS = 96, 32, 64, 2, 8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: torch.Tensor, ctx: RankContext):
        super().__init__()
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.weight = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)

    def forward(self, ids):
        mask = (ids >= self.lo) & (ids < self.hi)
        out = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        out = out * mask.unsqueeze(-1)
        dist.all_reduce(out)                   # every rank gets the full embedding
        return out


class MLPDecoderLayer(nn.Module):
    def __init__(self, up: torch.Tensor, down: torch.Tensor, ctx: RankContext):
        super().__init__()
        self.up = nn.Parameter(up.chunk(ctx.world_size, 0)[ctx.rank].clone(), requires_grad=False)
        self.down = nn.Parameter(down.chunk(ctx.world_size, 1)[ctx.rank].clone(), requires_grad=False)

    def forward(self, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        out = nn.functional.linear(torch.relu(nn.functional.linear(residual, self.up)), self.down)
        dist.all_reduce(out)                   # row-parallel output: reduce before it rejoins the stream
        return out, residual


class TinyTPModel(nn.Module):
    def __init__(self, ctx: RankContext, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)   # the same full weights on every rank
        self.embed_tokens = VocabParallelEmbedding(torch.randn(VOCAB, HIDDEN, generator=g), ctx)
        self.layers = nn.ModuleList(
            MLPDecoderLayer(torch.randn(FFN, HIDDEN, generator=g) * HIDDEN ** -0.5,
                            torch.randn(HIDDEN, FFN, generator=g) * FFN ** -0.5, ctx) for _ in range(LAYERS))

    def forward(self, ids):
        h, r = self.embed_tokens(ids), None
        for layer in self.layers:
            h, r = layer(h, r)
        return h + r


def build(ctx: RankContext) -> ProbeTarget:
    model = TinyTPModel(ctx, seed=ctx.seed).to(ctx.device)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids, num_layers=LAYERS,
                       hidden_size=HIDDEN, dtype=torch.float32, arch="my-mlp")
