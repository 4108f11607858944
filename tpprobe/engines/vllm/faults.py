"""Faults made vLLM's own way, in vLLM's own model (`tpprobe probe --engine vllm --inject`).

Each breaks the model where the real bug lives and never touches what tpprobe observes: the probe's
door at `GroupCoordinator.all_reduce` sees the broken call as vLLM issues it.

  skip-allreduce@K (F2 / F24 for one layer)  layer K's `self_attn.o_proj`, a RowParallelLinear, is set
      `reduce_results=False` (vLLM's own flag: "the caller reduces") and nobody reduces: its output
      stays this rank's partial sum
  skip-allreduce-all (F24)  the same in every layer
  allreduce-scaled@K, allreduce-one-buffer@K, allreduce-stale@K (F22)  the TP group's device
      communicator (on CPU vLLM's CpuCommunicator: shared memory or gloo) returns, for layer K's o_proj
      reduce, the sum x TPPROBE_INJECT_SCALE (2), rank 0's input, or the previous reduce's output
      (zeros when there is none), on every rank: a custom all-reduce returning wrong data; `@K.mlp` picks
      layer K's MLP reduce (`mlp.down_proj`) instead of its attention's (`self_attn.o_proj`)
  allreduce-rank@R (F23)  on rank R only, the middle layer's o_proj reduce returns R's own input
  allreduce-once@R:C (F33)  on rank R only, the C-th call (0-based, counted from the fault's injection) of the
      TP group's device communicator returns the sum x TPPROBE_INJECT_SCALE (2): a reduce right in every other
      call, wrong in one, on one rank (an intermittent custom all-reduce)
  skip-unreadable-allreduce@K (F25)  on vLLM's shared-memory path, layer K's o_proj reduce is dropped where
      vLLM's CPU communicator dispatches it: `torch.ops._C.shm_allreduce` never runs and each rank keeps its
      partial sum. A c10d-level audit cannot read that op (the catalogue's F25); at vLLM's GroupCoordinator
      door it is read, and named by its module
  aux-no-residual (F27)  vLLM's EAGLE-3 capture appends a layer's `hidden_states` alone, without the
      residual its decoder layers return beside it (`output[0]`: vllm-lens PR #7, vLLM-Hook PR #11): every
      slot but the embedding's holds half the stream
  drop-final-id (F29)  the backbone never offers the final layer's output to the EAGLE-3 capture: vLLM's
      `_maybe_add_hidden_state` is not called for id N (as deepseek_v2's loop did until vLLM PR #46973),
      so an id N in `aux_hidden_state_layers` captures nothing and the draft gets one slot fewer
  deferred-reduce-capture@K (F28)  layer K's `mlp.down_proj` (a RowParallelLinear) is set `reduce_results=False`
      and its sum is completed later in the same stream, by a reduce issued on the way into the next norm (layer
      K+1's `input_layernorm`, the final norm after the last layer): vLLM moving a layer's reduce into model code
      (`ResidualStream`, `Scatter.PARTIAL`; not in vLLM 0.32.0), the stream right once it completes. vLLM's
      EAGLE-3 capture appends the stream between the two (`_maybe_add_hidden_state` after layer K), so a draft
      asking for the stream leaving layer K reads each rank's partial sum plus the residual

A corrupt call still runs the real reduce first, so every rank issues the same collectives.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from tpprobe.core.errors import UsageError
from tpprobe.config.knobs import knob_float
from tpprobe.engines.fault_fired import counter

SUPPORTED = ("skip-allreduce", "skip-allreduce-all", "allreduce-scaled", "allreduce-one-buffer",
             "allreduce-stale", "allreduce-rank", "skip-unreadable-allreduce", "aux-no-residual", "drop-final-id",
             "deferred-reduce-capture", "allreduce-once")


def _o_projs(model) -> list:
    layers = list(getattr(getattr(model, "model", model), "layers", None) or [])
    return [getattr(getattr(layer, "self_attn", None), "o_proj", None) for layer in layers]


def inject(name: str, model, arg: Optional[int] = None, ctx=None) -> None:
    """Apply fault `name` to vLLM model `model` on this rank."""
    if name not in SUPPORTED:
        raise UsageError(f"--inject {name} is not made on vLLM's models yet; with --engine vllm inject "
                         f"{', '.join(SUPPORTED)}")
    if name == "allreduce-once":
        rank, _, call = str(arg).partition(":")
        if not (rank.isdigit() and call.isdigit()):
            raise UsageError(f"--inject allreduce-once@{arg}: give RANK:CALL, e.g. allreduce-once@1:95")
        communicator_once(int(rank), int(call), ctx)
        return
    projs = _o_projs(model)
    L = len(projs)
    if name == "drop-final-id":
        drop_final_id(model, L)
        return
    if name == "aux-no-residual":
        aux_no_residual(model)
        return
    if name == "skip-unreadable-allreduce":
        drop_shm_reduce(projs[arg])
        return
    if name == "deferred-reduce-capture":
        defer_reduce(model, arg)
        return
    if name == "skip-allreduce-all":
        for p in projs:
            p.reduce_results = False
        return
    if name == "skip-allreduce":
        projs[arg].reduce_results = False
        return
    if name == "allreduce-rank":
        communicator_fault(name, projs[L // 2], arg, ctx)
        return
    communicator_fault(name, _reduce_of(model, projs, arg, name), arg, ctx)


def _reduce_of(model, projs: list, arg, fault: str):
    """The row-parallel layer whose reduce `@arg` names: `K` layer K's `self_attn.o_proj`, `K.mlp` its
    `mlp.down_proj`."""
    k, _, part = str(arg).partition(".")
    if not k.isdigit() or int(k) >= len(projs) or part not in ("", "mlp"):
        raise UsageError(f"--inject {fault}@{arg}: give a layer K in 0..{len(projs) - 1} (its attention's reduce) "
                         f"or K.mlp (its MLP's, mlp.down_proj)")
    if not part:
        return projs[int(k)]
    layers = list(getattr(getattr(model, "model", model), "layers", None) or [])
    proj = getattr(getattr(layers[int(k)], "mlp", None), "down_proj", None)
    if proj is None:
        raise UsageError(f"--inject {fault}@{arg}: layer {k} of vLLM's {type(model).__name__} has no mlp.down_proj "
                         f"(a dense MLP: --arch llama, qwen3)")
    return proj


def _capture_fn(model, fault: str):
    """(the backbone, its bound EagleModelMixin._maybe_add_hidden_state); UsageError for a backbone with its
    own capture loop (deepseek_v2)."""
    inner = getattr(model, "model", model)
    orig = getattr(inner, "_maybe_add_hidden_state", None)
    if orig is None:
        raise UsageError(f"--inject {fault}: vLLM's {type(inner).__name__} has its own capture loop (no "
                         f"_maybe_add_hidden_state to break); use --arch llama, qwen3 or qwen3_moe")
    return inner, orig


def aux_no_residual(model) -> None:
    """F27: vLLM's capture appends h, not h + r (a hook that reads a decoder layer's output[0])."""
    inner, orig = _capture_fn(model, "aux-no-residual")
    fire = counter("a capture with a residual in vLLM's EAGLE-3 _maybe_add_hidden_state")

    def maybe_add(aux, layer_idx, hidden_states, residual):
        if residual is not None:
            fire()
        return orig(aux, layer_idx, hidden_states, None)      # vLLM's own rule: no residual -> h alone

    inner._maybe_add_hidden_state = maybe_add


def defer_reduce(model, k: int) -> None:
    """F28: layer k's down_proj leaves its sum owed; the next norm completes it before it normalizes."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    from tpprobe.engines.vllm.stream import norms_after

    layers = list(getattr(getattr(model, "model", model), "layers", None) or [])
    proj = getattr(getattr(layers[k], "mlp", None), "down_proj", None) if 0 <= k < len(layers) else None
    norms = norms_after(model)
    if proj is None or not hasattr(proj, "reduce_results") or norms is None:
        raise UsageError(f"--inject deferred-reduce-capture@{k}: layer {k} of vLLM's {type(model).__name__} has no "
                         f"row-parallel mlp.down_proj whose reduce can be deferred (a dense MLP: --arch llama, qwen3)")
    proj.reduce_results = False
    norm = norms[k]
    orig = norm.forward

    def forward(x, residual=None, *a, **kw):
        # the owed sum completes here, on the way into the norm (vLLM's deferred / fused all-reduce + RMSNorm)
        return orig(tensor_model_parallel_all_reduce(x), residual, *a, **kw)

    norm.forward = forward        # an instance attribute: the module's __call__ finds it


def drop_shm_reduce(proj) -> None:
    """F25: the reduce `proj` (a RowParallelLinear) issues is dropped inside vLLM's shared-memory dispatcher:
    `_CPUSHMDistributed.all_reduce` returns without running `torch.ops._C.shm_allreduce`."""
    from vllm.distributed.parallel_state import get_tp_group

    dm = get_tp_group().device_communicator.dist_module
    if type(dm).__name__ != "_CPUSHMDistributed":
        raise UsageError("--inject skip-unreadable-allreduce drops a reduce on vLLM's shared-memory path; this run's "
                         "TP group reduces over gloo: unset TPPROBE_VLLM_ALLREDUCE (shm is the default)")
    orig = dm.all_reduce
    inside = threading.local()
    proj.register_forward_pre_hook(lambda m, a: setattr(inside, "on", True))
    proj.register_forward_hook(lambda m, a, o: setattr(inside, "on", False))
    fire = counter("a shared-memory all-reduce issued inside the row-parallel layer's forward")

    def all_reduce(input, group=None):
        if getattr(inside, "on", False):
            fire()
            return None                 # dropped: every rank keeps its partial sum
        return orig(input, group)

    dm.all_reduce = all_reduce


def drop_final_id(model, num_layers: int) -> None:
    """F29: the loop's call for id N (after the last layer) never reaches vLLM's capture."""
    inner, orig = _capture_fn(model, "drop-final-id")
    fire = counter(f"vLLM's EAGLE-3 capture offered the final layer's output (_maybe_add_hidden_state for id "
                   f"{num_layers})")

    def maybe_add(aux, layer_idx, hidden_states, residual):
        if layer_idx == num_layers:
            fire()
            return aux
        return orig(aux, layer_idx, hidden_states, residual)

    inner._maybe_add_hidden_state = maybe_add      # an instance attribute: the forward's self. lookup finds it


def communicator_fault(name: str, proj, arg: Optional[int], ctx) -> None:
    """Break the TP group's device communicator for the reduce `proj` (a RowParallelLinear) issues."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    comm = tp.device_communicator
    orig = comm.all_reduce            # the bound method of vLLM's communicator (CpuCommunicator on CPU)
    rank = ctx.rank if ctx is not None else dist.get_rank()
    scale = knob_float("TPPROBE_INJECT_SCALE")
    inside = threading.local()
    last: dict = {}

    proj.register_forward_pre_hook(lambda m, a: setattr(inside, "on", True))
    proj.register_forward_hook(lambda m, a, o: setattr(inside, "on", False))
    fire = counter("a reduce of the TP group's device communicator issued inside the row-parallel layer's forward"
                   + (f", on rank {arg}" if name == "allreduce-rank" else ""))

    def all_reduce(input_):
        if not getattr(inside, "on", False):
            out = orig(input_)
            last["out"] = out.detach().clone()
            return out
        mine = input_.detach().clone()
        out = orig(input_)                # the real reduce runs on every rank
        if name != "allreduce-rank" or rank == arg:
            fire()
        if name == "allreduce-rank" and rank != arg:
            pass
        elif name == "allreduce-scaled":
            out.mul_(scale)
        elif name == "allreduce-one-buffer":
            dist.broadcast(mine, src=tp.ranks[0], group=tp.cpu_group)
            out.copy_(mine)
        elif name == "allreduce-stale":
            prev = last.get("out")
            out.copy_(prev if prev is not None and prev.shape == out.shape else torch.zeros_like(out))
        elif name == "allreduce-rank":
            out.copy_(mine)
        last["out"] = out.detach().clone()
        return out

    comm.all_reduce = all_reduce      # an instance attribute: GroupCoordinator calls it as vLLM would


def communicator_once(bad_rank: int, bad_call: int, ctx=None) -> None:
    """F33: on rank `bad_rank` the `bad_call`-th call of the TP group's device communicator returns the sum
    scaled; every other call, and every call on the other ranks, is vLLM's own."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    comm = tp.device_communicator
    orig = comm.all_reduce
    rank = tp.rank_in_group
    scale = knob_float("TPPROBE_INJECT_SCALE")
    calls = {"n": 0}
    fire = counter(f"call {bad_call} of the TP group's device communicator on rank {bad_rank}")

    def all_reduce(input_):
        out = orig(input_)            # the real reduce runs on every rank, every call
        if rank == bad_rank and calls["n"] == bad_call:
            fire()
            out = out * scale
        calls["n"] += 1
        return out

    comm.all_reduce = all_reduce      # an instance attribute: GroupCoordinator calls it as vLLM would
