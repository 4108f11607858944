"""A sequence-parallel TP model whose reduce-scatter and all-gather go through a communicator of its
own, as an engine's do (a custom kernel above c10d that reports each call to the audit through
`tap.collective`, like SGLang's GroupCoordinator and the F22 faults of the built-in model). Each
layer reduce-scatters its row-parallel partial sum over the tokens and all-gathers the chunks back:
the all-reduce split in two. Used by tests/ranks/test_audit_verdicts.py and tests/ranks/test_sweep.py: a wrong
reduce-scatter (not the slice of the sum) and a wrong all-gather (not the concatenation) are named
at their collective, by their own definition.

Factories (`tpprobe probe --model tests.zoo.sp_comm:NAME`, from the repository root):

  healthy  the communicator, nothing wrong
  wrong    the communicator broken as SP_FAULT says (MECH@K or MECH@K:R; SP_SCALE: the factor),
           at layer K's collective (SP_DTYPE: the model's dtype, float32); every call still runs the real
           collective, so every rank issues the same ones:

    rs-scaled@K     the reduce-scatter returns its slice of the sum x SP_SCALE (2), on every rank
    rs-own@K:R      on rank R, the reduce-scatter returns R's own slice of its input, unsummed
                    (the sum never happened there)
    rs-other@K      the reduce-scatter returns the next rank's slice of the sum, on every rank
                    (a wrong offset; every rank, as the full sum it slices takes one more collective)
    ag-stale@K[:R]  the all-gather's block of rank (R + 1) % tp (no R: rank 1's) is the previous
                    all-gather's, on rank R (no R: every rank): that write never landed
                    (zeros in layer 0: a fresh buffer)
    ag-swap@K[:R]   the all-gather's blocks of ranks 0 and 1 exchanged, on rank R (no R: every rank)

  A reduce-scatter's wrong chunk is all-gathered to every rank, so the ranks agree on a wrong
  stream: only the audit's pairs show it. An all-gather wrong on every rank likewise; one wrong on
  rank R makes R's stream diverge from there on.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, FFN, LAYERS, TOKENS = 96, 32, 64, 4, 8
PATH = "tests.zoo.sp_comm.Comm"


def fault() -> tuple[str, int, Optional[int]]:
    """SP_FAULT parsed: (mechanism, layer, rank or None)."""
    spec = os.environ.get("SP_FAULT", "rs-scaled@2")
    mech, _, at = spec.partition("@")
    k, _, r = at.partition(":")
    return mech, int(k), int(r) if r else None


class Comm:
    def __init__(self, ctx: RankContext, broken: bool):
        self.ctx, self.tap = ctx, None
        self.mech, self.layer, self.rank = fault() if broken else ("", -1, None)
        self.scale = float(os.environ.get("SP_SCALE", "2"))
        self.last_gather: Optional[torch.Tensor] = None

    def extension(self, tap) -> list:
        self.tap = tap if getattr(tap, "audit", False) else None
        comm = self

        class _Off:
            def remove(self):
                comm.tap = None
        return [_Off()]

    def _record(self, kind: str, fn, x: torch.Tensor, op: str) -> torch.Tensor:
        if self.tap is None:
            return fn(x)
        with self.tap.collective(kind, f"{PATH}.{kind}", x, self.ctx.world_size, op=op) as rec:
            y = fn(x)
            rec.output(y)
        return y

    def _hit(self, mech: str, layer: int) -> bool:
        return self.mech == mech and self.layer == layer and self.rank in (None, self.ctx.rank)

    def reduce_scatter(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        def run(x):
            w, r = self.ctx.world_size, self.ctx.rank
            y = torch.empty(x.shape[0] // w, *x.shape[1:], dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(y, x.contiguous(), group=self.ctx.group)
            if self._hit("rs-scaled", layer):
                return y * self.scale
            if self._hit("rs-own", layer):
                return x.chunk(w, 0)[r].clone()
            if self._hit("rs-other", layer):
                full = x.clone()
                dist.all_reduce(full, group=self.ctx.group)
                return full.chunk(w, 0)[(r + 1) % w].clone()
            return y
        return self._record("reduce_scatter", run, x, "SUM")

    def all_gather(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        def run(x):
            w = self.ctx.world_size
            y = torch.empty(x.shape[0] * w, *x.shape[1:], dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(y, x.contiguous(), group=self.ctx.group)
            n = x.shape[0]
            if self._hit("ag-stale", layer):
                q = (self.rank + 1) % w if self.rank is not None else 1
                old = self.last_gather if self.last_gather is not None and self.last_gather.shape == y.shape \
                    else torch.zeros_like(y)
                y[q * n:(q + 1) * n] = old[q * n:(q + 1) * n]
            elif self._hit("ag-swap", layer):
                b0, b1 = y[:n].clone(), y[n:2 * n].clone()
                y[:n], y[n:2 * n] = b1, b0
            self.last_gather = y.detach().clone()
            return y
        return self._record("all_gather", run, x, "CAT")


class Embedding(nn.Module):
    """Vocab-parallel: each rank holds a slice of the table; the partial lookups are all-reduced."""

    def __init__(self, g, ctx):
        super().__init__()
        full = torch.randn(VOCAB, HIDDEN, generator=g)
        per = VOCAB // ctx.world_size
        self.lo, self.hi = ctx.rank * per, (ctx.rank + 1) * per
        self.table = nn.Parameter(full[self.lo:self.hi].clone(), requires_grad=False)
        self.group = ctx.group

    def forward(self, tokens):
        keep = ((tokens >= self.lo) & (tokens < self.hi)).unsqueeze(-1)
        out = torch.where(keep, self.table[(tokens - self.lo).clamp(0, self.hi - self.lo - 1)], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class Block(nn.Module):
    def __init__(self, g, ctx, k: int, comm: Comm):
        super().__init__()
        w, r = ctx.world_size, ctx.rank
        self.k, self.comm = k, comm
        self.norm = nn.LayerNorm(HIDDEN)
        up = torch.randn(FFN, HIDDEN, generator=g) * HIDDEN ** -0.5
        down = torch.randn(HIDDEN, FFN, generator=g) * FFN ** -0.5
        self.up = nn.Parameter(up.chunk(w, 0)[r].clone(), requires_grad=False)       # column-parallel
        self.down = nn.Parameter(down.chunk(w, 1)[r].clone(), requires_grad=False)   # row-parallel

    def forward(self, x):
        partial = torch.relu(self.norm(x) @ self.up.t()) @ self.down.t()
        chunk = self.comm.reduce_scatter(partial, self.k)       # this rank's tokens, summed
        return x + self.comm.all_gather(chunk, self.k)           # every token again


class Model(nn.Module):
    def __init__(self, ctx: RankContext, comm: Comm):
        super().__init__()
        g = torch.Generator().manual_seed(ctx.seed)
        self.embed = Embedding(g, ctx)
        self.blocks = nn.ModuleList(Block(g, ctx, k, comm) for k in range(LAYERS))

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return x


def _target(ctx: RankContext, broken: bool) -> ProbeTarget:
    comm = Comm(ctx, broken)
    dtype = getattr(torch, os.environ.get("SP_DTYPE", "float32"))
    model = Model(ctx, comm).to(device=ctx.device, dtype=dtype).eval()
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids, num_layers=LAYERS,
                       hidden_size=HIDDEN, dtype=dtype, arch="sp-comm", tap_extensions=(comm.extension,))


def healthy(ctx: RankContext) -> ProbeTarget:
    return _target(ctx, False)


def wrong(ctx: RankContext) -> ProbeTarget:
    return _target(ctx, True)
