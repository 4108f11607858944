"""A small TP model whose layers switch sharding with an all-to-all (DeepSpeed-Ulysses style):
each rank takes its chunk of the tokens, an all-to-all hands every rank all tokens of its slice of
the features, a row-parallel matmul on that slice is all-reduced, and a replicated MLP finishes
the layer. Used by tests/ranks/test_audit_verdicts.py: the audit checks each all-to-all by its own
definition (output chunk q, on rank r, is bit for bit rank q's input chunk r).

Factories (`tpprobe probe --model tests.zoo.a2a:NAME`, from the repository root):

  healthy  the all-to-all through `torch.distributed.all_to_all_single` with explicit split sizes
  wrong    the all-to-all through a communicator above c10d that reports each call to the audit
           (`tap.collective`), broken the way a custom all-to-all kernel breaks: in layer 1, on
           rank 1, the chunk from rank 0 never lands (the buffer holds zeros). The reduce after it
           sums the wrong partial, so every rank agrees on a wrong stream: only the audit shows it.
"""
import torch
import torch.distributed as dist
from torch import nn

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, TOKENS, LAYERS = 64, 32, 16, 3
PATH = "tests.zoo.a2a.Comm.all_to_all"


class Comm:
    def __init__(self, ctx: RankContext, broken: bool):
        self.ctx, self.broken, self.tap = ctx, broken, None

    def extension(self, tap) -> list:
        self.tap = tap if getattr(tap, "audit", False) else None
        comm = self

        class _Off:
            def remove(self):
                comm.tap = None
        return [_Off()]

    def all_to_all(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.tap is None:
            return self._run(x, layer)
        with self.tap.collective("all_to_all", PATH, x, self.ctx.world_size, op="PERMUTE") as rec:
            y = self._run(x, layer)
            rec.output(y)
        return y

    def _run(self, x, layer):
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=self.ctx.group)
        if self.broken and layer == 1 and self.ctx.rank == 1:
            y[: x.shape[0] // self.ctx.world_size] = 0          # rank 0's chunk never landed
        return y


class Layer(nn.Module):
    def __init__(self, g: torch.Generator, ctx: RankContext, k: int, comm):
        super().__init__()
        w = ctx.world_size
        self.k, self.ctx, self.comm = k, ctx, comm
        self.norm = nn.LayerNorm(HIDDEN)
        full = torch.randn(HIDDEN, HIDDEN, generator=g) * HIDDEN ** -0.5
        self.w_in = nn.Parameter(full.chunk(w, 0)[ctx.rank].clone(), requires_grad=False)   # its feature rows
        self.w_out = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) * HIDDEN ** -0.5, requires_grad=False)

    def forward(self, x):
        w, r = self.ctx.world_size, self.ctx.rank
        h = self.norm(x)
        mine = h.chunk(w, 0)[r]                                  # this rank's tokens
        send = torch.cat([c for c in mine.chunk(w, 1)], 0).contiguous()   # chunk j: feature slice j, for rank j
        if self.comm is not None:
            got = self.comm.all_to_all(send, self.k)
        else:
            got = torch.empty_like(send)
            n = send.shape[0] // w
            dist.all_to_all_single(got, send, [n] * w, [n] * w, group=self.ctx.group)
        part = got @ self.w_in                                    # every token, this feature slice: a partial sum
        dist.all_reduce(part, group=self.ctx.group)
        return x + torch.nn.functional.silu(part) @ self.w_out


class Model(nn.Module):
    def __init__(self, ctx: RankContext, comm=None):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        self.layers = nn.ModuleList(Layer(g, ctx, k, comm) for k in range(LAYERS))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def _target(ctx: RankContext, comm=None) -> ProbeTarget:
    model = Model(ctx, comm).to(ctx.device).eval()
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids, num_layers=LAYERS,
                       hidden_size=HIDDEN, dtype=torch.float32, arch="zoo-a2a",
                       tap_extensions=(comm.extension,) if comm is not None else ())


def healthy(ctx: RankContext) -> ProbeTarget:
    return _target(ctx)


def wrong(ctx: RankContext) -> ProbeTarget:
    return _target(ctx, Comm(ctx, broken=True))
