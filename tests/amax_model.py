"""The built-in TP model with an FP8-style amax sync in every layer: each MLP's input absmax is
all-reduced with op=MAX (and, for the product check, its row-norm ratio with op=PRODUCT), as FP8
scaling syncs its amax over the TP ranks. Used by tests/test_audit_verdicts.py: the audit checks
each op by its own definition, and says what an exchange mode cannot check.

`tpprobe probe --model tests.amax_model:build` (from the repository root)."""
import torch
import torch.distributed as dist

from tpprobe import ProbeTarget, RankContext
from tpprobe.model import BuiltinConfig, build_builtin


def build(ctx: RankContext) -> ProbeTarget:
    t = build_builtin(ctx, BuiltinConfig(num_layers=4, layer_ids=[-1, 1]))

    def amax(module, args):
        x = args[0]
        a = x.abs().amax(-1, keepdim=True).float().clone()        # this rank's amax per token
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=ctx.group)
        m = (a / a.max()).clone()
        dist.all_reduce(m, op=dist.ReduceOp.MIN, group=ctx.group)
        p = (1.0 + 0.01 * m).clone()
        dist.all_reduce(p, op=dist.ReduceOp.PRODUCT, group=ctx.group)

    for layer in t.model.layers:
        layer.mlp.register_forward_pre_hook(amax)
    t.arch = "custom"
    return t
