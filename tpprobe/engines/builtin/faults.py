"""Fault injection into the built-in model: what each failure of the catalogue looks like.

`--inject NAME[@N]` (repeatable). @K is a layer index, @R a rank. Each fault changes the model the
way the real bug does (a skipped reduce, a sub-group, a stale copy, a capture taken wrong), never
the probe: the probe must find it on its own.
"""
from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...core.errors import UsageError
from ...config.knobs import knob_float
from ...core.target import ProbeTarget, RankContext
from ..fault_fired import counter

from ...config.fault_names import FAULTS
from ..fault_ops import shm_allreduce_op  # noqa: F401  (the names, torch-free for --help)


@dataclass(frozen=True)
class Fault:
    name: str
    arg: Optional[int]

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}@{self.arg}"


def parse(specs: list[str], world: int, num_layers: int, layer_ids: list[int]) -> list[Fault]:
    out = []
    for spec in specs or []:
        name, _, arg = spec.partition("@")
        if name not in FAULTS:
            raise UsageError(f"unknown fault {name!r} in --inject; known: {', '.join(FAULTS)}")
        _, kind, required = FAULTS[name]
        if kind is None and arg:
            raise UsageError(f"--inject {name} takes no @argument (got {spec!r})")
        if required and not arg:
            raise UsageError(f"--inject {name} needs @{'K (a layer index)' if kind == 'layer' else 'R (a rank)'}, "
                             f"e.g. {name}@1")
        n = None
        if arg:
            try:
                n = int(arg)
            except ValueError:
                raise UsageError(f"--inject {spec}: @{arg} is not an integer")
            if kind == "layer" and not 0 <= n < num_layers:
                raise UsageError(f"--inject {spec}: layer {n} out of range 0..{num_layers - 1}")
            if kind == "rank" and not 0 <= n < world:
                raise UsageError(f"--inject {spec}: rank {n} out of range 0..{world - 1} (world size {world})")
        if name == "subgroup-allreduce" and (world < 4 or world % 2):
            raise UsageError(f"--inject {name} needs an even tp >= 4 (got {world}): run with --nproc 4")
        if name in ("drop-embed-slot", "slot-order") and (len(layer_ids) < 2 or
                                                          (name == "drop-embed-slot" and layer_ids[0] != -1)):
            raise UsageError(f"--inject {name} needs --layers starting with -1 and at least 2 ids (got {layer_ids})")
        out.append(Fault(name, n))
    return out


def adjust_layer_ids(faults: list[Fault], layer_ids: list[int], num_layers: int) -> list[int]:
    """drop-last-id asks for id L-1, which SGLang-Llama's +1 maps past the loop."""
    if any(f.name == "drop-last-id" for f in faults):
        ids = [i for i in layer_ids if i != num_layers - 1]
        return ids[:-1] + [num_layers - 1] if len(ids) >= 2 else ids + [num_layers - 1]
    return layer_ids


def prepare_groups(faults: list[Fault], ctx: RankContext) -> dict:
    """Collective set-up some faults need (every rank must call new_group in the same order)."""
    groups = {}
    if any(f.name == "subgroup-allreduce" for f in faults):
        half = ctx.world_size // 2
        lo = dist.new_group(list(range(half)))
        hi = dist.new_group(list(range(half, ctx.world_size)))
        groups["sub"] = lo if ctx.rank < half else hi
    return groups


def apply(faults: list[Fault], target: ProbeTarget, ctx: RankContext, groups: dict) -> None:
    """Break the built-in model (SGLang's and vLLM's models: their engine's `inject`)."""
    from .model import TPModel, all_reduce

    if not faults:
        return
    model = target.model
    if not isinstance(model, TPModel):
        raise UsageError("--inject works on the built-in model only here (drop --model)")
    L = len(model.layers)
    mid = L // 2
    for f in faults:
        k = f.arg if f.arg is not None else mid
        mine = f.arg is None or f.arg == ctx.rank
        n = f.name
        if n == "skip-embed-allreduce":
            model.embed_tokens.skip_reduce = True
        elif n == "skip-allreduce":
            model.layers[k].self_attn.o_proj.reduce_results = False
        elif n == "subgroup-allreduce":
            o = model.layers[k].self_attn.o_proj
            o.ctx = copy.copy(o.ctx)
            o.ctx.group = groups["sub"]
        elif n == "rank-noise" and mine:
            model.layers[mid].self_attn.o_proj.register_forward_hook(_nudge_ulp)
        elif n == "rank-weight" and mine:
            with torch.no_grad():   # a stale copy of a replicated weight on this rank only
                model.layers[mid].input_layernorm.weight.mul_(1.25)
        elif n == "slice-capture":
            w, r = ctx.world_size, ctx.rank

            def sliced(i, h, res, w=w, r=r):
                full = h if res is None else h + res
                step = full.shape[-1] // w
                return full[..., r * step:(r + 1) * step].clone()
            model.capture_fn = sliced
        elif n == "capture-offset":
            model.layers_to_capture = [i + 1 if i < 0 else i for i in target.model_layer_ids]
        elif n == "drop-embed-slot":
            ids = target.model_layer_ids
            nxt = min(ids[-1] + max(ids[-1] - ids[-2], 1), L - 2)
            serving = ids[1:] + [nxt]
            model.layers_to_capture = [i + 1 for i in serving]
        elif n == "slot-order":
            model.pack_fn = lambda aux: torch.cat([aux[1], aux[0], *aux[2:]], dim=-1)
        elif n == "alias-capture":
            buf: dict = {}

            def aliased(i, h, res, buf=buf):
                v = h if res is None else h + res
                if "b" not in buf:
                    buf["b"] = torch.empty_like(v)
                return buf["b"].copy_(v)          # no clone: every slot is the same buffer
            model.capture_fn = aliased
        elif n == "nan" and mine:
            model.layers[mid].register_forward_hook(_poison)
        elif n == "capture-no-residual":      # F18 (SpecForge#431): the layer's output alone, not the stream
            model.capture_fn = lambda i, h, res: h.clone()
        elif n == "capture-dtype" and mine:
            other = torch.float32 if target.dtype != torch.float32 else torch.bfloat16
            model.capture_fn = lambda i, h, res, o=other: (h if res is None else h + res).to(o)
        elif n == "capture-noncontig":
            model.pack_fn = lambda aux: torch.cat(aux, dim=-1).t().contiguous().t()
        elif n == "extra-collective" and mine:
            def extra(m, a, out, c=ctx):
                all_reduce(torch.zeros_like(out), c)   # one more all-reduce than the other ranks issue
            model.layers[mid].mlp.register_forward_hook(extra)
        elif n == "embed-after-norm":
            norm = model.layers[0].input_layernorm
            base = model.capture_fn

            def after_norm(i, h, res, norm=norm, base=base):
                if i == 0:
                    return norm(h)
                return base(i, h, res) if base else (h.clone() if res is None else h + res)
            model.capture_fn = after_norm
        elif n == "kill-rank" and mine:
            model.layers[mid].register_forward_pre_hook(_die)
        elif n == "hang-rank" and mine:
            model.layers[mid].register_forward_pre_hook(_hang)
        elif n == "skip-allreduce-all":           # F24: reduce_results=False in every layer
            for layer in model.layers:
                layer.self_attn.o_proj.reduce_results = False
        elif n in ("allreduce-scaled", "allreduce-one-buffer", "allreduce-stale", "allreduce-rank",
                   "skip-unreadable-allreduce"):
            j = mid if n == "allreduce-rank" else k
            comm = Communicator(ctx, n, model.layers[j].self_attn.o_proj, rank=f.arg if n == "allreduce-rank" else None,
                                name=f"layers.{j}.self_attn.o_proj")
            comm.install(model)
            target.tap_extensions = (*target.tap_extensions, comm.extension)


# ---- F22-F25: the built-in model's reduces through a communicator of its own ------------------------
# Engines do not reduce through torch.distributed.all_reduce alone: vLLM's custom all-reduce, its CPU
# shared-memory `_C.shm_allreduce`, SGLang's GroupCoordinator sit above c10d (or beside it), and that
# is the part that breaks. `Communicator` gives the built-in model one: every row-parallel module
# (o_proj, down_proj) is built with reduce_results=False and reduces through it. It reports each
# reduce to the audit the way such a wrapper does (`tap.collective`, capture/audit/: the c10d op it
# runs inside is folded into that one record), so the audit reads its input and its output, and one
# call, at one module, goes wrong as the catalogue says:
#
#   allreduce-scaled@K      F22  layer K's o_proj reduce returns the sum × TPPROBE_INJECT_SCALE (2) on every rank
#   allreduce-one-buffer@K  F22  ... returns rank 0's input on every rank (one rank's buffer handed to all)
#   allreduce-stale@K       F22  ... returns the previous reduce's output (zeros for the first: a fresh buffer)
#   allreduce-rank@R        F23  on rank R only, the middle layer's o_proj reduce returns R's own input
#                                (the sum never happened there: a one-shot read before the peers' writes)
#   skip-unreadable-allreduce@K  F25  the reduces go through an op the audit can count but not read (a
#                                custom op named like vLLM's `_C.shm_allreduce`), and layer K's is never issued
#
# Each corrupt call still runs the real reduce, so every rank issues the same collectives (a rank
# that skipped one would hang its peers, a different fault: F12/F14).
PATH = "tpprobe.engines.builtin.faults.Communicator.all_reduce"


class Communicator:
    def __init__(self, ctx: RankContext, fault: str, at: torch.nn.Module, rank: Optional[int] = None,
                 name: str = "the row-parallel layer"):
        self.ctx, self.fault, self.at, self.rank = ctx, fault, at, rank
        self.scale = knob_float("TPPROBE_INJECT_SCALE")
        self.tap = None
        self.last: Optional[torch.Tensor] = None
        self.shm = shm_allreduce_op(ctx.group) if fault == "skip-unreadable-allreduce" else None
        self.fire = counter(f"the reduce of {name}'s output in the model's communicator"
                            + (f", on rank {rank}" if rank is not None else ""))

    def install(self, model) -> None:
        from .model import RowParallelLinear

        for layer in model.layers:
            for m in layer.modules():
                if isinstance(m, RowParallelLinear):
                    m.reduce_results = False
                    m.forward = self._forward(m)

    def _forward(self, m):
        from .model import RowParallelLinear

        def forward(x, m=m):
            return self.all_reduce(RowParallelLinear.forward(m, x), m is self.at)
        return forward

    def extension(self, tap) -> list:
        self.tap = tap if getattr(tap, "audit", False) else None
        comm = self

        class _Off:
            def remove(self):
                comm.tap = None
        return [_Off()]

    def all_reduce(self, out: torch.Tensor, hit: bool) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return out
        if self.shm is not None:
            if hit:
                self.fire()
            return out if hit else self.shm(out)          # F25: this one is never issued
        if self.tap is None:
            y = self._reduce(out, hit)
        else:
            with self.tap.collective("all_reduce", PATH, out, self.ctx.world_size) as rec:
                y = self._reduce(out, hit)
                rec.output(y)
        self.last = y.detach().clone()
        return y

    def _reduce(self, out: torch.Tensor, hit: bool) -> torch.Tensor:
        mine = out.detach().clone()
        y = out.clone()
        dist.all_reduce(y, group=self.ctx.group)
        if not hit or (self.rank is not None and self.rank != self.ctx.rank):
            return y
        self.fire()
        if self.fault == "allreduce-scaled":
            return y * self.scale
        if self.fault == "allreduce-one-buffer":
            dist.broadcast(mine, src=dist.get_global_rank(self.ctx.group, 0) if self.ctx.group else 0,
                           group=self.ctx.group)
            return mine
        if self.fault == "allreduce-stale":
            return self.last.clone() if self.last is not None and self.last.shape == y.shape else torch.zeros_like(y)
        if self.fault == "allreduce-rank":
            return mine
        return y


def _nudge_ulp(module, args, out):
    # 1-2 ULP on every element, as a different reduction order would give
    up = torch.nextafter(out, torch.full_like(out, float("inf")))
    return torch.where(torch.arange(out.numel(), device=out.device).view_as(out) % 2 == 0,
                       torch.nextafter(up, torch.full_like(out, float("inf"))), up)


def _poison(module, args, out):
    h = out[0] if isinstance(out, tuple) else out
    h.view(-1)[:1].fill_(float("nan"))     # a fill kernel: no host tensor, so it can be graph-captured
    return out


def _die(module, args):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(17)


def _hang(module, args):
    while True:
        time.sleep(3600)
