"""The built-in TP model with an FP8-style amax sync in every layer: the absmax of each rank's
shard of the MLP activation (down_proj's input) is all-reduced with op=MAX, as FP8 scaling syncs
its amax over the TP ranks, then each rank's share of it with op=MIN and a product of per-rank
factors with op=PRODUCT. Used by tests/ranks/test_audit_verdicts.py: the audit checks each op by its
own definition, and says what an exchange mode cannot check.

Factories (`tpprobe probe --model tests.zoo.amax:NAME`, from the repository root):

  build   the syncs through `torch.distributed.all_reduce` (the c10d door)
  synced  the same syncs through a communicator above c10d that reports each call to the audit
          (`tap.collective`, as SGLang's GroupCoordinator and the F22 faults do), nothing wrong
  wrong   the same communicator, broken the way a one-shot / custom all-reduce breaks:
            layer 0's MAX on rank 1 returns rank 1's own amax (the sync never happened there)
            layer 1's MIN returns rank 0's value on every rank (one rank's buffer handed to all)
            layer 2's PRODUCT returns the product x 2 on every rank (a wrong value everywhere)
          each call still runs the real reduce, so every rank issues the same collectives; the
          values only feed the syncs, so the stream agrees and only the audit's pairs show it
  drawn   one such fault, as AMAX_FAULT says (tests/ranks/test_sweep.py draws it): OP:HOW@K[:R], OP MAX or
          MIN, at layer K: own@K:R (rank R's own value on rank R), rank0@K (rank 0's on every rank),
          scaled@K (the reduction x 2 on every rank)
"""
import os

import torch
import torch.distributed as dist

from tpprobe import ProbeTarget, RankContext
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin

PATH = "tests.zoo.amax.Sync.all_reduce"
# (layer, op) -> how that call goes wrong (the `wrong` factory)
WRONG = {(0, "MAX"): "own", (1, "MIN"): "rank0", (2, "PRODUCT"): "scaled"}


class Sync:
    """An amax communicator: reports each reduce to the audit like a wrapper above c10d."""

    def __init__(self, ctx: RankContext, wrong: dict):
        self.ctx, self.wrong, self.tap = ctx, wrong, None

    def extension(self, tap) -> list:
        self.tap = tap if getattr(tap, "audit", False) else None
        sync = self

        class _Off:
            def remove(self):
                sync.tap = None
        return [_Off()]

    def all_reduce(self, x: torch.Tensor, op: str, layer: int) -> torch.Tensor:
        if self.tap is None:
            return self._reduce(x, op, layer)
        with self.tap.collective("all_reduce", PATH, x, self.ctx.world_size, op=op) as rec:
            y = self._reduce(x, op, layer)
            rec.output(y)
        return y

    def _reduce(self, x: torch.Tensor, op: str, layer: int) -> torch.Tensor:
        mine = x.detach().clone()
        y = x.clone()
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=self.ctx.group)
        how = self.wrong.get((layer, op))
        own = 1                                   # the rank whose sync never happened ("own")
        if isinstance(how, tuple):
            how, own = how
        if how == "own" and self.ctx.rank == own:
            return mine
        if how == "rank0":
            dist.broadcast(mine, src=dist.get_global_rank(self.ctx.group, 0) if self.ctx.group else 0,
                           group=self.ctx.group)
            return mine
        if how == "scaled":
            return y * 2
        return y


def _make(ctx: RankContext, sync=None) -> ProbeTarget:
    t = build_builtin(ctx, BuiltinConfig(num_layers=4, layer_ids=[-1, 1]))

    def reduce(x, op, k):
        if sync is not None:
            return sync.all_reduce(x, op, k)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=ctx.group)
        return x

    def amax(module, args, k):
        x = args[0]                                                 # this rank's shard of the activation
        a = reduce(x.abs().amax(-1, keepdim=True).float().clone(), "MAX", k)
        m = reduce((x.abs().amax(-1, keepdim=True).float() / a.clamp_min(1e-30)).clone(), "MIN", k)
        reduce((1.0 + 0.01 * m).clone(), "PRODUCT", k)

    for k, layer in enumerate(t.model.layers):
        layer.mlp.down_proj.register_forward_pre_hook(lambda mod, args, k=k: amax(mod, args, k))
    if sync is not None:
        t.tap_extensions = (*t.tap_extensions, sync.extension)
    t.arch = "custom"
    return t


def build(ctx: RankContext) -> ProbeTarget:
    return _make(ctx)


def synced(ctx: RankContext) -> ProbeTarget:
    return _make(ctx, Sync(ctx, {}))


def wrong(ctx: RankContext) -> ProbeTarget:
    return _make(ctx, Sync(ctx, WRONG))


def drawn(ctx: RankContext) -> ProbeTarget:
    op, _, rest = os.environ["AMAX_FAULT"].partition(":")
    how, _, at = rest.partition("@")
    k, _, r = at.partition(":")
    return _make(ctx, Sync(ctx, {(int(k), op): (how, int(r)) if how == "own" else how}))
