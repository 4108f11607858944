"""The all-reduce audit at vLLM's own level: `GroupCoordinator.all_reduce` (and `all_gather`).

vLLM reduces through `tensor_model_parallel_all_reduce(x)` -> `GroupCoordinator.all_reduce` -> (the
custom op `torch.ops.vllm.all_reduce` where the platform asks for it; not on CPU) ->
`_all_reduce_out_place` -> `device_communicator.all_reduce(x)`: on CPU `CpuCommunicator`, shared
memory (`torch.ops._C.shm_allreduce`, in place) or torch.distributed over gloo; on GPUs
`CudaCommunicator` (symmetric memory, FlashInfer, custom all-reduce, pynccl, torch last), none of
which a c10d-level audit sees. The door (tpprobe.engines.door) records each call once at the
coordinator, its input read on entry and its result on return: every reduce is READ, completeness
checked, on whichever path vLLM took; the op it ends in is named in the record's path (`via`).

Under torch.compile (vLLM's GPU default) the compiled graph calls the custom op `torch.ops.vllm.all_reduce`
without the Python `all_reduce`; the op runs `GroupCoordinator._all_reduce_out_place`, a door of its own
(tpprobe.engines.door), and the dispatcher lets the op through to it (`door_below`), so it is recorded once
and READ. vLLM's fused all-reduce + RMSNorm (`torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm`, put in
the graph by the AllReduceFusionPass) never reaches the coordinator: its door is FlashInfer's
`allreduce_fusion` as vLLM's modules hold it, read as `residual_out - residual_in` (the sum the kernel added
to the residual) or, for the plain all-reduce pattern, its result. The GPU communicators below the
coordinator (custom all-reduce, pynccl, symmetric memory, FlashInfer, quick-AR) are named in the record's
path when they ran. docs/vllm.md has the table of every path and what ran where.

Imports vLLM's parallel_state only, when the Tap starts (no CPU workaround): usable on GPUs too.
"""
from __future__ import annotations

import sys

from tpprobe.capture.audit import door_below
from tpprobe.capture.hooks import LAYER_EXTENSIONS
from tpprobe.engines.door import coordinator_door, fused_door, path_marks

PATH = "vllm.GroupCoordinator"
FUSED = "flashinfer.comm.allreduce_fusion"
# the custom ops whose implementation reaches a door here (recorded there, once)
OPS = {"all_reduce": "vllm.all_reduce", "fused": "vllm.flashinfer_trtllm_fused_allreduce_norm"}
# vLLM's modules that hold FlashInfer's comm module (the fused op's and the standalone FlashInfer all-reduce's)
FI_HOLDERS = ("vllm.compilation.passes.fusion.allreduce_rms_fusion",
              "vllm.distributed.device_communicators.flashinfer_all_reduce")
# (module, class, method, the name the record's path gets): the communicators CudaCommunicator.all_reduce picks
MARKS = (("custom_all_reduce", "CustomAllreduce", "custom_all_reduce", "CustomAllreduce.custom_all_reduce"),
         ("pynccl", "PyNcclCommunicator", "all_reduce", "PyNcclCommunicator.all_reduce"),
         ("symm_mem", "SymmMemCommunicator", "all_reduce", "SymmMemCommunicator.all_reduce"),
         ("flashinfer_all_reduce", "FlashInferAllReduce", "all_reduce", "FlashInferAllReduce.all_reduce"),
         ("quick_all_reduce", "QuickAllReduce", "quick_all_reduce", "QuickAllReduce.quick_all_reduce"),
         ("aiter_custom_all_reduce", "AiterCustomAllreduce", "custom_all_reduce",
          "AiterCustomAllreduce.custom_all_reduce"),
         ("flashinfer_pcie_ipc_all_reduce", "FlashInferPcieIpcAllReduce", "all_reduce",
          "FlashInferPcieIpcAllReduce.all_reduce"))


def _pattern(comm, name: str):
    return getattr(getattr(comm, "AllReduceFusionPattern", None), name, None)


def fused_read(comm):
    """What of a `flashinfer.comm.allreduce_fusion(**kwargs)` call is the reduce (see fused_door): the
    plain all-reduce pattern returns it; the residual patterns add it to `residual_in` into `residual_out`
    (vLLM's fused all-reduce + RMSNorm: in place, or into the input with a zero residual), so it is read as
    `residual_out - residual_in` (the residual copied on entry; the difference in float64, then the input's
    dtype). Anything else is counted unchecked."""
    plain = _pattern(comm, "kAllReduce")

    def read(kw):
        import torch

        inp, pattern = kw.get("input"), kw.get("pattern")
        if plain is not None and pattern == plain:
            return inp, lambda out: out if isinstance(out, torch.Tensor) else kw.get("output")
        r_in, r_out = kw.get("residual_in"), kw.get("residual_out")
        if isinstance(r_in, torch.Tensor) and isinstance(r_out, torch.Tensor) and isinstance(inp, torch.Tensor):
            before = r_in.detach().clone()
            return inp, lambda out: (r_out.detach().double() - before.double()).to(inp.dtype).view(inp.shape)
        return inp, None

    return read


def _tp_group(kw):
    """The group vLLM's FlashInfer calls reduce over: the TP group (their workspace is made on its CPU group)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def fused_extension(tap) -> list:
    """Tap extension: a door on FlashInfer's `allreduce_fusion` as vLLM's modules hold it (only where
    vLLM imported it: the fusion pass or the FlashInfer communicator), and the fused op let through to it."""
    seen, handles = set(), []
    for name in FI_HOLDERS:
        comm = getattr(sys.modules.get(name), "flashinfer_comm", None)
        if comm is None or id(comm) in seen:
            continue
        seen.add(id(comm))
        handles += fused_door(tap, comm, "allreduce_fusion", FUSED, fused_read(comm), _tp_group)
    if handles:
        handles.append(door_below(OPS["fused"]))
    return handles


# fused kernels that reduce outside the coordinator and whose sum cannot be read from their arguments: each call is
# counted unchecked (a coverage warning names it). DeepSeek-V4.1's all-reduce + mHC finalize (CuTe DSL, tp 4 with
# NVLink multicast only): it reduces the MoE's unfinalized expert outputs inside the kernel.
COUNTED = (("vllm.models.deepseek_v41.nvidia.ops.cute_dsl", "AllReduceMHC", "finalize"),)


def counted_extension(tap) -> list:
    """Tap extension: the fused reduces of COUNTED, where vLLM imported them, counted as unreadable."""
    handles = []
    for mod, cls_name, method in COUNTED:
        cls = getattr(sys.modules.get(mod), cls_name, None)
        if cls is not None:
            handles += fused_door(tap, cls, method, f"{cls_name}.{method}", lambda kw: (None, None), _tp_group)
    return handles


def marks_extension(tap) -> list:
    """Tap extension: the GPU communicator each reduce went through, named in its record's path."""
    entries = []
    for mod, cls_name, method, name in MARKS:
        cls = getattr(sys.modules.get(f"vllm.distributed.device_communicators.{mod}"), cls_name, None)
        if cls is not None:
            entries.append((cls, method, name))
    return path_marks(tap, entries)


def coordinator_audit_extension(tap) -> list:
    """Tap extension: every vLLM `GroupCoordinator.all_reduce` / `all_gather` of the forward, one read
    record each."""
    try:
        from vllm.distributed.parallel_state import GroupCoordinator
    except Exception:  # noqa: BLE001 - no vllm: nothing to audit at this level
        return []
    handles = coordinator_door(tap, GroupCoordinator, PATH, op_methods=("_all_reduce_out_place",))
    if handles:
        handles.append(door_below(OPS["all_reduce"]))
        handles += fused_extension(tap) + marks_extension(tap) + counted_extension(tap)
    return handles


def vllm_extensions() -> tuple:
    """Every Tap extension a vLLM model needs (ProbeTarget.tap_extensions): the residual stream read where
    vLLM completes it, at the norm after each layer (tpprobe.engines.vllm.stream: a reduce a layer defers is
    done by then), and the coordinator door."""
    from tpprobe.engines.vllm.stream import residual_stream_extension

    return (residual_stream_extension, coordinator_audit_extension)


# the Tap adds these by itself wherever it finds vLLM's layers (a --model factory too)
LAYER_EXTENSIONS["vllm."] = vllm_extensions
