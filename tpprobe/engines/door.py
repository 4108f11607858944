"""The audit door at an engine's group coordinator, written once for every engine.

An engine's TP reduces all go through one Python method (`GroupCoordinator.all_reduce` in SGLang and
in vLLM); where they end depends on the device (vLLM on CPU: shared memory `_C.shm_allreduce` or
gloo; on GPUs custom all-reduce, pynccl, symmetric memory, FlashInfer, torch last). Wrapping that
method records each reduce once through `tap.collective` (tpprobe/capture/hooks/collectives.py), with its
input copied or summarized on entry and its result on return, so the audit READS it (completeness
checked) whichever path ran below; what the dispatcher sees inside (a c10d op, `_C.shm_allreduce`)
is folded into the record's `via`, never counted twice. `all_gather` is wrapped the same way (the
logits gather: without it a shared-memory all-gather would be counted and unreadable).

`coordinator_door(tap, cls, label)` is the Tap extension both engines use: tpprobe.engines.vllm.audit
(all-reduce and all-gather) and tpprobe.engines.sglang.audit (all-reduce).
"""
from __future__ import annotations

import torch


class Restore:
    """A handle that puts a class attribute back (a Tap extension's `remove()`)."""

    def __init__(self, cls, name, orig):
        self._args = (cls, name, orig)

    def remove(self) -> None:
        if self._args is not None:
            cls, name, orig = self._args
            setattr(cls, name, orig)
            self._args = None


def _name_group(rec, coord) -> None:
    import torch.distributed as dist

    if rec.group is None:          # the outermost wrapper names the group
        ranks = [int(r) for r in (getattr(coord, "ranks", None) or [])]
        rec.group = getattr(coord, "unique_name", None)
        whole = dist.is_initialized() and len(ranks) == dist.get_world_size()
        rec.group_ranks = None if whole or not ranks else ranks


def coordinator_door(tap, cls, label: str, gather: bool = True) -> list:
    """Wrap `cls.all_reduce` (and `cls.all_gather`) so every call with more than one rank is one read
    record named `{label}.all_reduce`. Returns the handles that undo it."""
    if not tap.audit or not hasattr(tap, "collective"):
        return []
    handles = []
    orig = cls.__dict__["all_reduce"]

    def all_reduce(self, input_, *args, **kwargs):
        if not isinstance(input_, torch.Tensor) or getattr(self, "world_size", 1) == 1:
            return orig(self, input_, *args, **kwargs)
        with tap.collective("all_reduce", f"{label}.all_reduce", input_, int(self.world_size)) as rec:
            _name_group(rec, self)
            out = orig(self, input_, *args, **kwargs)
            rec.output(out if isinstance(out, torch.Tensor) else input_)
        return out

    cls.all_reduce = all_reduce
    handles.append(Restore(cls, "all_reduce", orig))
    if gather and "all_gather" in cls.__dict__:
        orig_g = cls.__dict__["all_gather"]

        def all_gather(self, input_, dim: int = -1, *args, **kwargs):
            if not isinstance(input_, torch.Tensor) or getattr(self, "world_size", 1) == 1 or input_.dim() == 0:
                return orig_g(self, input_, dim, *args, **kwargs)
            d = dim % input_.dim()
            # the audit reads an all-gather chunk by chunk along dim 0: a gather along dim d is the same
            # gather of the tensors with d moved first (the logits gather is along the vocabulary, dim -1)
            seen = input_ if d == 0 else input_.movedim(d, 0).contiguous()
            with tap.collective("all_gather", f"{label}.all_gather", seen, int(self.world_size)) as rec:
                _name_group(rec, self)
                out = orig_g(self, input_, dim, *args, **kwargs)
                rec.output(out if d == 0 or not isinstance(out, torch.Tensor) else out.movedim(d, 0).contiguous())
            return out

        cls.all_gather = all_gather
        handles.append(Restore(cls, "all_gather", orig_g))
    return handles
