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
(all-reduce and all-gather) and tpprobe.engines.sglang.audit (all-reduce). Where a class has the method the
engine's custom op calls (vLLM's `_all_reduce_out_place`, what `torch.ops.vllm.all_reduce` runs when a
torch.compile'd graph reduces without the Python `all_reduce`), that method is a door too: nested under
`all_reduce` it is folded into the record's path, alone it records the reduce itself. Under Dynamo's
tracing the doors step aside (the engine's own method is traced; the op it emits meets the inner door
when the graph runs).

`fused_door(tap, module, fn, label, read)` opens a door on a fused kernel entry that reduces outside the
coordinator (FlashInfer's `allreduce_fusion`, which vLLM's fused all-reduce + RMSNorm op calls): `read`
says what of the call is the reduce's output (READ), or None (counted unchecked: a coverage warning names it).
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


def _tracing() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # noqa: BLE001 - an older torch: no Dynamo check, never tracing here
        return False


def _reduce_door(tap, cls, name: str, label: str, inner: bool = False):
    orig = cls.__dict__[name]
    auditor = getattr(tap, "auditor", None)

    def door(self, input_, *args, **kwargs):
        if not isinstance(input_, torch.Tensor) or getattr(self, "world_size", 1) == 1 or _tracing() \
                or inner and auditor is not None and auditor.active_record is not None:
            # an inner door under the outer one's record: the path stays the outer door's
            return orig(self, input_, *args, **kwargs)
        with tap.collective("all_reduce", f"{label}.{name}", input_, int(self.world_size)) as rec:
            _name_group(rec, self)
            out = orig(self, input_, *args, **kwargs)
            rec.output(out if isinstance(out, torch.Tensor) else input_)
        return out

    setattr(cls, name, door)
    return Restore(cls, name, orig)


def coordinator_door(tap, cls, label: str, gather: bool = True, op_methods: tuple = ()) -> list:
    """Wrap `cls.all_reduce` (and `cls.all_gather`, and `op_methods`: what the engine's custom all-reduce
    op runs, vLLM's `_all_reduce_out_place`) so every call with more than one rank is one read record
    named `{label}.all_reduce` (or `{label}._all_reduce_out_place` when the op is reached without the
    Python method). Returns the handles that undo it."""
    if not tap.audit or not hasattr(tap, "collective"):
        return []
    handles = [_reduce_door(tap, cls, "all_reduce", label)]
    handles += [_reduce_door(tap, cls, m, label, inner=True) for m in op_methods if m in cls.__dict__]
    if gather and "all_gather" in cls.__dict__:
        orig_g = cls.__dict__["all_gather"]

        def all_gather(self, input_, dim: int = -1, *args, **kwargs):
            if not isinstance(input_, torch.Tensor) or getattr(self, "world_size", 1) == 1 or input_.dim() == 0 \
                    or _tracing():
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


def fused_door(tap, module, fn: str, label: str, read, coordinator) -> list:
    """Wrap `module.<fn>` (a fused kernel entry that reduces outside any coordinator, looked up on
    `module` at each call) so every call is one record named `label`. `read(kwargs) -> (input, finish)`:
    the reduce's input tensor, and `finish(result) -> output tensor or None` run after the call (None:
    the output cannot be read; the reduce is counted unchecked and the coverage warning names `label`).
    `coordinator(kwargs)`: the group it reduces over (its `world_size`, `ranks`, `unique_name`). Returns the
    handle that undoes it."""
    if not tap.audit or not hasattr(tap, "collective") or module is None or not hasattr(module, fn):
        return []
    orig = module.__dict__.get(fn, getattr(module, fn))
    auditor = getattr(tap, "auditor", None)

    def door(*args, **kwargs):
        if _tracing():
            return orig(*args, **kwargs)
        if auditor is not None and auditor.active_record is not None:
            auditor.active_record.via.append(label)     # under a coordinator's record: it reads the result
            return orig(*args, **kwargs)
        # called positionally (or a method: the instance first): its first tensor is counted, nothing is read
        inp, finish = (next((a for a in args if isinstance(a, torch.Tensor)), None), None) if args \
            else read(kwargs)
        coord = coordinator(kwargs)
        n = int(getattr(coord, "world_size", 1))
        if not isinstance(inp, torch.Tensor) or n <= 1:
            return orig(*args, **kwargs)
        with tap.collective("all_reduce", label, inp, n) as rec:
            _name_group(rec, coord)
            out = orig(*args, **kwargs)
            got = finish(out) if finish is not None else None
            if isinstance(got, torch.Tensor):
                rec.output(got)
            else:
                # the reduce ran but what it returned cannot be read: counted, never HEALTHY over it
                rec.checked, rec.inp, rec.inp_summary = False, None, None
        return out

    setattr(module, fn, door)
    return [Restore(module, fn, orig)]


def path_marks(tap, entries) -> list:
    """Name the communicator a reduce went through: wrap each `(cls, method, name)` so that a call made
    inside a door's record that returns a tensor adds `name` to the record's path (`via`); outside one it
    runs untouched (the engine's dispatcher calls these only from inside its coordinator)."""
    auditor = getattr(tap, "auditor", None)
    if not tap.audit or auditor is None:
        return []
    handles = []
    for cls, method, name in entries:
        orig = cls.__dict__.get(method)
        if orig is None:
            continue

        def mark(self, *args, _orig=orig, _name=name, **kwargs):
            rec = auditor.active_record
            at = len(rec.via) if rec is not None else 0
            out = _orig(self, *args, **kwargs)
            if rec is not None and isinstance(out, torch.Tensor) and not _tracing():
                rec.via.insert(at, _name)        # before the ops it issued: the path reads top down
            return out

        setattr(cls, method, mark)
        handles.append(Restore(cls, method, orig))
    return handles
