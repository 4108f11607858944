"""What the audit asks c10d: a group's size and ranks, and the wait on a c10d op's work."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_Work = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None)
_PG = getattr(dist, "ProcessGroup", None)


def group_size_of(pg) -> int:
    try:
        return dist.ProcessGroup.unbox(pg).size()
    except Exception:
        return -1


# ProcessGroup object -> (it, size, its sub_ranks): asked at every collective of the doors' path, the
# same answer for the group's life. Keyed by the object (held, so its id is not reused), never by a
# group's name (names are given again after destroy_process_group); a few groups per process, bounded.
_SUB: dict = {}


def sub_ranks(pg, size: int) -> Optional[list]:
    """The global ranks of a sub-group collective (None for the whole world, or when unknown): the
    check sums over these ranks only. Asked only when the group is smaller than the world."""
    hit = _SUB.get(id(pg))
    if hit is not None and hit[0] is pg and hit[1] == size:
        return hit[2]
    got = _sub_ranks(pg, size)
    if _PG is not None and isinstance(pg, _PG) and dist.is_initialized():
        if len(_SUB) > 64:
            _SUB.clear()
        _SUB[id(pg)] = (pg, size, got)
    return got


def _sub_ranks(pg, size: int) -> Optional[list]:
    try:
        if size <= 0 or not dist.is_initialized() or size >= dist.get_world_size():
            return None
        if isinstance(pg, str):
            from torch.distributed.distributed_c10d import _resolve_process_group
            pg = _resolve_process_group(pg)
        elif isinstance(pg, torch.ScriptObject):
            pg = dist.ProcessGroup.unbox(pg)
        return [int(r) for r in dist.get_process_group_ranks(pg)]
    except Exception:
        return None


def named_group_size(name: str) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(name).size()
    except Exception:
        return -1


def wait(result) -> None:
    """Wait for the work a c10d op returned (below the op's Python binding it is the TorchBind
    ScriptObject, not the Python Work): through the Python Work it boxes, ``Work.unbox``. Calling
    ``wait`` on the ScriptObject itself crashed the process on a NCCL work (segmentation fault,
    torch 2.11 + NCCL 2.28 on an H200; gloo's did not)."""
    try:
        # (tensors, work) from most c10d ops; a lone Work from alltoall_base_
        work = result[1] if isinstance(result, (tuple, list)) else result
        if work is None:
            return
        if isinstance(work, torch.ScriptObject) and _Work is not None and hasattr(_Work, "unbox"):
            work = _Work.unbox(work)
        if hasattr(work, "wait"):
            work.wait()
    except Exception:
        pass
