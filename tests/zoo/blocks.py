"""A GPT-J-shaped TP model for the partial-sum signature: each block computes
attention and MLP from one norm, in parallel, on its shards, and reduces their SUM itself with
`torch.distributed.all_reduce`. Nothing in it is row-parallel by structure (plain Parameters, no
reduce flag, no `input_is_parallel`, no DTensor), so a reduce that never runs can be named only
from the audit's count, where another layer vouches for it, or from the data.

Factories (`tpprobe probe --model tests.zoo.blocks:NAME`, from the repository root):

  healthy      3 blocks, every reduce runs
  drop_all     3 blocks, no block reduces (the caller was meant to, and nobody does)
  one_layer    1 block that does not reduce
  first_of_two 2 blocks, block 0 does not reduce
  last         3 blocks, the last does not reduce (the other two vouch by their count)
  nudged       3 blocks, every reduce runs, rank 1's stream is scaled by 1.01 in block 0 (a
               rank-dependent computation, not a partial sum: must not be named one)
"""
import torch
import torch.distributed as dist
from torch import nn

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, FFN, TOKENS = 64, 32, 64, 8


class Block(nn.Module):
    def __init__(self, g: torch.Generator, ctx: RankContext, reduce: bool, scale: float):
        super().__init__()
        w, r = ctx.world_size, ctx.rank
        self.ln = nn.LayerNorm(HIDDEN)
        self.qv = nn.Parameter((torch.randn(2 * FFN, HIDDEN, generator=g) * HIDDEN ** -0.5).chunk(w, 0)[r].clone(),
                               requires_grad=False)
        self.out = nn.Parameter((torch.randn(HIDDEN, FFN, generator=g) * FFN ** -0.5).chunk(w, 1)[r].clone(),
                                requires_grad=False)
        self.fc_in = nn.Parameter((torch.randn(FFN, HIDDEN, generator=g) * HIDDEN ** -0.5).chunk(w, 0)[r].clone(),
                                  requires_grad=False)
        self.fc_out = nn.Parameter((torch.randn(HIDDEN, FFN, generator=g) * FFN ** -0.5).chunk(w, 1)[r].clone(),
                                   requires_grad=False)
        self.reduce, self.scale = reduce, scale

    def forward(self, x):
        h = self.ln(x)
        q, v = (h @ self.qv.t()).chunk(2, -1)
        y = (torch.softmax(q @ q.t() / 8.0, -1) @ v) @ self.out.t() \
            + torch.nn.functional.gelu(h @ self.fc_in.t()) @ self.fc_out.t()
        if self.reduce:
            dist.all_reduce(y)
        return (x + y) * self.scale


class Model(nn.Module):
    def __init__(self, ctx: RankContext, layers: int, drop=(), nudge: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        self.blocks = nn.ModuleList(Block(g, ctx, k not in drop, 1.01 if nudge and k == 0 and ctx.rank == 1 else 1.0)
                                    for k in range(layers))

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return x


def _target(ctx: RankContext, layers: int, **kw) -> ProbeTarget:
    model = Model(ctx, layers, **kw).to(ctx.device).eval()
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids, num_layers=layers, hidden_size=HIDDEN,
                       dtype=torch.float32, arch="zoo-block")


def healthy(ctx):
    return _target(ctx, 3)


def drop_all(ctx):
    return _target(ctx, 3, drop=(0, 1, 2))


def one_layer(ctx):
    return _target(ctx, 1, drop=(0,))


def first_of_two(ctx):
    return _target(ctx, 2, drop=(0,))


def last(ctx):
    return _target(ctx, 3, drop=(2,))


def nudged(ctx):
    return _target(ctx, 3, nudge=True)
