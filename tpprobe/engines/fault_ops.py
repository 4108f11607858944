"""An all-reduce op the audit can count but not read (F25), for the faults of builtin/faults.py and
engines/sglang/faults.py: `torch.ops.tpprobe_fault.shm_allreduce`, named like vLLM's CPU `_C.shm_allreduce`."""
from __future__ import annotations

import torch
import torch.distributed as dist

# process-wide by nature: a torch.library op is defined once per process; the group is the last fault's
_SHM: dict = {"lib": None, "group": None}


def _shm_allreduce_impl(x: torch.Tensor) -> torch.Tensor:
    # the sum runs on a helper thread: the audit watches its own thread only, so like the real
    # shared-memory kernel the op is one collective the audit can count and not look inside
    import threading

    y = x.clone()
    t = threading.Thread(target=dist.all_reduce, args=(y,), kwargs={"group": _SHM["group"]})
    t.start()
    t.join()
    return y


def shm_allreduce_op(group):
    """torch.ops.tpprobe_fault.shm_allreduce: an all-reduce the audit counts by name but cannot read."""
    _SHM["group"] = group
    if _SHM["lib"] is None:
        lib = torch.library.Library("tpprobe_fault", "DEF")
        lib.define("shm_allreduce(Tensor x) -> Tensor")
        lib.impl("shm_allreduce", _shm_allreduce_impl, "CompositeExplicitAutograd")
        _SHM["lib"] = lib
    return torch.ops.tpprobe_fault.shm_allreduce
