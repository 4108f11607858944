"""`--model tests.zoo.disagree:NAME` factories whose ranks disagree on purpose.

Each builds the built-in TP model and adds one rank-dependent difference through a Tap extension
(a forward hook on decoder layer 2), the way a user's model with a rank-dependent bug would:
an extra capture point on one rank, a point whose shape or dtype differs on rank 1, or an
all-reduce whose shape differs on rank 1 (same element count, so the collective itself completes
and only the audit can tell). `raises` and `wrong_type` are broken factories for the usage tests.
No test functions live here; the ranks import this module by name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpprobe import ProbeTarget, RankContext
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin


def _with_hook(ctx: RankContext, hook) -> ProbeTarget:
    target = build_builtin(ctx, BuiltinConfig(layer_ids=[-1, 1, 3]))
    layer = target.model.layers[2]

    def ext(tap):
        def fire(module, args, out):
            h = out[0] if isinstance(out, tuple) else out
            hook(tap, h.detach(), ctx)
        return [layer.register_forward_hook(fire)]

    target.tap_extensions = (ext,)
    return target


def extra_point(ctx: RankContext) -> ProbeTarget:
    """Rank 1 captures one point more (different capture count and names)."""
    def hook(tap, h, ctx):
        if ctx.rank == 1:
            tap.record_point("extra.rank1_only", h)
    return _with_hook(ctx, hook)


def point_shape(ctx: RankContext) -> ProbeTarget:
    """The same point, half the hidden size on rank 1."""
    def hook(tap, h, ctx):
        tap.record_point("extra.probe", h[..., : h.shape[-1] // 2] if ctx.rank == 1 else h)
    return _with_hook(ctx, hook)


def point_dtype(ctx: RankContext) -> ProbeTarget:
    """The same point, float64 on rank 1."""
    def hook(tap, h, ctx):
        tap.record_point("extra.probe", h.double() if ctx.rank == 1 else h)
    return _with_hook(ctx, hook)


def collective_shape(ctx: RankContext) -> ProbeTarget:
    """One extra all-reduce on every rank, shaped [T, H] on rank 0 and [H, T] on rank 1."""
    def hook(tap, h, ctx):
        x = torch.zeros_like(h)
        dist.all_reduce(x.t().contiguous() if ctx.rank == 1 else x)
    return _with_hook(ctx, hook)


def raises(ctx: RankContext) -> ProbeTarget:
    raise RuntimeError("this factory is broken on purpose")


def wrong_type(ctx: RankContext):
    return {"model": None}


def disagree(ctx: RankContext) -> ProbeTarget:
    """All of the above in one run (one launch instead of four on a small CI box): rank 1 has an
    extra point, a point of half the width, a float64 point, and an all-reduce shaped [H, T]."""
    def hook(tap, h, ctx):
        one = ctx.rank == 1
        if one:
            tap.record_point("extra.rank1_only", h)
        tap.record_point("extra.shape", h[..., : h.shape[-1] // 2] if one else h)
        tap.record_point("extra.dtype", h.double() if one else h)
        x = torch.zeros_like(h)
        dist.all_reduce(x.t().contiguous() if one else x)
    return _with_hook(ctx, hook)
