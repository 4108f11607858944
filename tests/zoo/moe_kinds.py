"""The built-in TP model made DeepSeek-shaped: layer 0 dense, layers 1-3 MoE-like, with a replicated
router (`mlp.router`) and a shared expert (`mlp.shared`) whose partial sum is reduced on its own
(a hand-written `torch.distributed.all_reduce`, as unfused shared-expert paths do), so an MoE layer
issues 3 reduces where the dense one issues 2. Used by tests/ranks/test_audit_verdicts.py: reduce counts
are compared within a layer kind (a dense layer is never held to the MoE layers' count).

Factories (`tpprobe probe --model tests.zoo.moe_kinds:NAME`, from the repository root):

  healthy      every reduce runs
  drop_shared  layer 2's shared-expert reduce never runs (nothing row-parallel by structure issues
               it: only the count of the other MoE layers names it)
"""
import torch
import torch.distributed as dist
from torch import nn

from tpprobe import ProbeTarget, RankContext
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin


class Shared(nn.Module):
    """A shared expert on this rank's slice of the hidden features: a partial sum, reduced here."""

    def __init__(self, hidden: int, ctx: RankContext, g: torch.Generator, reduce: bool):
        super().__init__()
        self.ctx, self.reduce = ctx, reduce
        full = torch.randn(hidden, hidden, generator=g) * hidden ** -0.5
        self.cols = slice(ctx.rank * hidden // ctx.world_size, (ctx.rank + 1) * hidden // ctx.world_size)
        self.w = nn.Parameter(full[self.cols].clone(), requires_grad=False)     # rows = its input features

    def forward(self, x):
        y = x[..., self.cols] @ self.w.to(x.dtype)
        if self.reduce:
            dist.all_reduce(y, group=self.ctx.group)
        return y


def _make(ctx: RankContext, drop=None) -> ProbeTarget:
    cfg = BuiltinConfig(num_layers=4, layer_ids=[-1, 1])
    t = build_builtin(ctx, cfg)
    g = torch.Generator().manual_seed(5)
    for k, layer in enumerate(t.model.layers):
        if k == 0:
            continue                                   # the dense layer
        mlp = layer.mlp
        mlp.router = nn.Linear(cfg.hidden, 4, bias=False).to(t.dtype)    # replicated: every rank routes alike
        with torch.no_grad():
            mlp.router.weight.copy_(torch.randn(4, cfg.hidden, generator=g))
        mlp.shared = Shared(cfg.hidden, ctx, g, reduce=k != drop)
        mlp.register_forward_hook(lambda m, args, out: out + 0.5 * m.shared(args[0]))
    t.arch = "custom"
    return t


def healthy(ctx: RankContext) -> ProbeTarget:
    return _make(ctx)


def drop_shared(ctx: RankContext) -> ProbeTarget:
    return _make(ctx, drop=2)
