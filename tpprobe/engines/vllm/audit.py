"""The all-reduce audit at vLLM's own level: `GroupCoordinator.all_reduce` (and `all_gather`).

vLLM reduces through `tensor_model_parallel_all_reduce(x)` -> `GroupCoordinator.all_reduce` -> (the
custom op `torch.ops.vllm.all_reduce` where the platform asks for it; not on CPU) ->
`_all_reduce_out_place` -> `device_communicator.all_reduce(x)`: on CPU `CpuCommunicator`, shared
memory (`torch.ops._C.shm_allreduce`, in place) or torch.distributed over gloo; on GPUs
`CudaCommunicator` (symmetric memory, FlashInfer, custom all-reduce, pynccl, torch last), none of
which a c10d-level audit sees. The door (tpprobe.engines.door) records each call once at the
coordinator, its input read on entry and its result on return: every reduce is READ, completeness
checked, on whichever path vLLM took; the op it ends in is named in the record's path (`via`).

Imports vLLM's parallel_state only, when the Tap starts (no CPU workaround): usable on GPUs too.
"""
from __future__ import annotations

from tpprobe.capture.hooks import LAYER_EXTENSIONS
from tpprobe.engines.door import coordinator_door

PATH = "vllm.GroupCoordinator"


def coordinator_audit_extension(tap) -> list:
    """Tap extension: every vLLM `GroupCoordinator.all_reduce` / `all_gather` of the forward, one read
    record each."""
    try:
        from vllm.distributed.parallel_state import GroupCoordinator
    except Exception:  # noqa: BLE001 - no vllm: nothing to audit at this level
        return []
    return coordinator_door(tap, GroupCoordinator, PATH)


def vllm_extensions() -> tuple:
    """Every Tap extension a vLLM model needs (ProbeTarget.tap_extensions): the residual stream read where
    vLLM completes it, at the norm after each layer (tpprobe.engines.vllm.stream: a reduce a layer defers is
    done by then), and the coordinator door."""
    from tpprobe.engines.vllm.stream import residual_stream_extension

    return (residual_stream_extension, coordinator_audit_extension)


# the Tap adds these by itself wherever it finds vLLM's layers (a --model factory too)
LAYER_EXTENSIONS["vllm."] = vllm_extensions
