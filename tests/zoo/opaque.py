"""Reduces through doors the audit cannot read (F20): the GPT-J block of tests.zoo.gptj, reducing
through a custom op (as SGLang's custom all-reduce / pynccl ops are) or point-to-point sends.

  custom_op       `torch.ops.tpzoo.custom_all_reduce` (a custom op that reduces inside): the audit
                  sees an op named like a collective, counts it per layer, cannot read it
  custom_op_drop  the same, layer ZOO_LAYER skips it
  p2p             the partial sums are exchanged with send / recv and summed by hand: no reduce at
                  all reaches the audit
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.zoo import gptj
from tests.zoo.common import fault_layer, target


@torch.library.custom_op("tpzoo::custom_all_reduce", mutates_args=())
def custom_all_reduce(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def _p2p_all_reduce(y: torch.Tensor) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    total = y.clone()
    for peer in range(world):
        if peer == rank:
            continue
        buf = torch.empty_like(y)
        if rank < peer:
            dist.send(y, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(y, peer)
        total += buf
    y.copy_(total)


class CustomOpBlock(gptj.Block):
    def all_reduce(self, y):
        return torch.ops.tpzoo.custom_all_reduce(y)


class P2PBlock(gptj.Block):
    def all_reduce(self, y):
        _p2p_all_reduce(y)
        return y


def _model(ctx, block, drop=None):
    m = gptj.GPTJ(ctx, drop=drop)
    for b in m.transformer.h:
        b.__class__ = block
    return m


def custom_op(ctx):
    return target(_model(ctx, CustomOpBlock), ctx, "zoo-opaque")


def custom_op_drop(ctx):
    return target(_model(ctx, CustomOpBlock, drop=fault_layer()), ctx, "zoo-opaque")


def p2p(ctx):
    return target(_model(ctx, P2PBlock), ctx, "zoo-opaque")
