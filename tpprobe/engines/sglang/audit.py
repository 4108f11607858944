"""The all-reduce audit at SGLang's own level: `GroupCoordinator.all_reduce`.

Every TP/attention-TP/MoE reduce of an SGLang model goes through `GroupCoordinator.all_reduce`
(`tensor_model_parallel_all_reduce` is `get_tp_group().all_reduce`; `attn_tp_all_reduce`,
`moe_tensor_model_parallel_all_reduce` the same on their groups). Where it ends depends on the
device: on CPU gloo in `torch.distributed.all_reduce`, on GPUs in custom all-reduce, pynccl,
symmetric memory, quick/flashinfer all-reduce or a torch custom op (sglang-serving.md section 5),
none of which calls `torch.distributed.all_reduce`. Auditing the coordinator records each reduce
once, with its group's name and size, whatever path it takes; a coordinator reduce that ends in
`torch.distributed.all_reduce` is not counted a second time (the Tap's re-entrancy guard,
`Tap.collective`, tpprobe/capture/audit.py). Reduces SGLang issues on WORLD with torch.distributed directly (the
DP-attention gather) are still seen by the Tap's own torch.distributed wrapper.

Imports sglang's parallel_state only (no CPU workarounds): used on GPUs by the plugin too.
"""
from __future__ import annotations

import torch


class _Restore:
    def __init__(self, cls, name, orig):
        self._args = (cls, name, orig)

    def remove(self) -> None:
        if self._args is not None:
            cls, name, orig = self._args
            setattr(cls, name, orig)
            self._args = None


def coordinator_audit_extension(tap) -> list:
    """Tap extension: record every `GroupCoordinator.all_reduce` of the forward (one record each,
    through `tap.collective`; the c10d op it ends in is folded into it), with its group's name and,
    for a sub-group (attention-TP under DP attention), its ranks."""
    if not tap.audit or not hasattr(tap, "collective"):
        return []
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator
    except Exception:  # noqa: BLE001 - no sglang: nothing to audit at this level
        return []
    import torch.distributed as dist

    orig = GroupCoordinator.__dict__["all_reduce"]

    def all_reduce(self, input_, *args, **kwargs):
        if not isinstance(input_, torch.Tensor) or getattr(self, "world_size", 1) == 1:
            return orig(self, input_, *args, **kwargs)
        with tap.collective("all_reduce", "sglang.GroupCoordinator.all_reduce", input_,
                            int(self.world_size)) as rec:
            if rec.group is None:        # the outermost wrapper names the group
                ranks = [int(r) for r in (getattr(self, "ranks", None) or [])]
                rec.group = getattr(self, "unique_name", None)
                whole = dist.is_initialized() and len(ranks) == dist.get_world_size()
                rec.group_ranks = None if whole or not ranks else ranks
            out = orig(self, input_, *args, **kwargs)
            rec.output(out if isinstance(out, torch.Tensor) else input_)
        return out

    GroupCoordinator.all_reduce = all_reduce
    return [_Restore(GroupCoordinator, "all_reduce", orig)]
