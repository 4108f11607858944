"""The all-reduce audit at SGLang's own level: `GroupCoordinator.all_reduce`.

Every TP/attention-TP/MoE reduce of an SGLang model goes through `GroupCoordinator.all_reduce`
(`tensor_model_parallel_all_reduce` is `get_tp_group().all_reduce`; `attn_tp_all_reduce`,
`moe_tensor_model_parallel_all_reduce` the same on their groups). Where it ends depends on the
device: on CPU gloo in `torch.distributed.all_reduce`, on GPUs in custom all-reduce, pynccl,
symmetric memory, quick/flashinfer all-reduce or a torch custom op (sglang-serving.md section 5),
none of which calls `torch.distributed.all_reduce`. Auditing the coordinator records each reduce
once, with its group's name and size, whatever path it takes; a coordinator reduce that ends in
`torch.distributed.all_reduce` is not counted a second time (the Tap's re-entrancy guard,
`Tap.collective`, tpprobe/capture/hooks/collectives.py). Reduces SGLang issues on WORLD with
torch.distributed directly (the DP-attention gather) are still seen by the Tap's own torch.distributed wrapper.

Imports sglang's parallel_state only (no CPU workarounds): used on GPUs by the plugin too.
"""
from __future__ import annotations

from ..door import coordinator_door

PATH = "sglang.GroupCoordinator"


def coordinator_audit_extension(tap) -> list:
    """Tap extension: record every `GroupCoordinator.all_reduce` of the forward (one record each,
    through `tap.collective`; the c10d op it ends in is folded into it), with its group's name and,
    for a sub-group (attention-TP under DP attention), its ranks: the engines' one door
    (tpprobe.engines.door), at SGLang's all-reduce only (its gathers are seen at c10d)."""
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator
    except Exception:  # noqa: BLE001 - no sglang: nothing to audit at this level
        return []
    return coordinator_door(tap, GroupCoordinator, PATH, gather=False)
