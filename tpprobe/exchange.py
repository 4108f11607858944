"""The tensor exchange, once every rank posted healthy metadata.

`gather_full` is the simple, reference path (`--exchange full`): every capture of every rank is
gathered onto rank 0 over a dedicated gloo group. Every rank derives the same gather sequence
from the posted metadata, so the collectives always match.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .capture import RankRecord
from .compare import dtype_from_str

_GROUP = None


def probe_group():
    """The probe's own gloo group (CPU tensors), apart from the model's collectives."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def gather_plan(posts: dict) -> list[tuple[str, list[int], str, bool]]:
    """[(name, shape, wire dtype, cast)] for tensors every rank holds with the same shape."""
    ranks = sorted(posts)
    idx = [posts[r]["index"] for r in ranks]
    plan = []
    for name in sorted(set(idx[0]).intersection(*idx[1:])):
        shapes = {tuple(i[name][0]) for i in idx}
        dtypes = {i[name][1] for i in idx}
        if len(shapes) != 1:
            continue
        cast = len(dtypes) != 1
        plan.append((name, list(shapes.pop()), "float64" if cast else dtypes.pop(), cast))
    return plan


def gather_full(ctx, tensors: dict, meta: dict, posts: dict) -> dict[int, RankRecord]:
    group = probe_group()
    world = ctx.world_size
    records = {r: RankRecord(r, posts[r]["meta"] if r != ctx.rank else meta, {}) for r in range(world)}
    for name, shape, wire, cast in gather_plan(posts):
        t = tensors[name].detach().to("cpu")
        t = (t.to(torch.float64) if cast else t).contiguous()
        bufs = [torch.empty(shape, dtype=dtype_from_str(wire)) for _ in range(world)] if ctx.rank == 0 else None
        dist.gather(t, gather_list=bufs, dst=0, group=group)
        if ctx.rank == 0:
            for r, b in enumerate(bufs):
                own = dtype_from_str(posts[r]["index"][name][1])
                records[r].tensors[name] = b.to(own) if cast else b
    return records if ctx.rank == 0 else {}
