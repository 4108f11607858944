"""The doors path: ProcessGroup's Python methods wrapped, recording what the kernel would, without its hop.

The kernel costs every collective a hop into Python and back (the dispatcher boxes the op's
TorchBind arguments, the kernel calls the op again; docs/benchmarks.md has the cost).  Most
collectives come through ProcessGroup's methods (`dist.all_reduce` calls `group.allreduce`, the
tensor forms of all-gather and reduce-scatter theirs), so while the kernels are registered those
methods are wrapped: the wrapper records the same record the kernel would, under the same op's name,
and runs the method below ADInplaceOrView, where the kernel is not called.  Every other door (a
direct `torch.ops.c10d` call, the functional collectives, SGLang's custom ops, the list forms) still
goes through the kernel.  TPPROBE_AUDIT_DOORS=0 (or `set_doors(False)`) leaves them closed."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...config.knobs import knob
from .c10d import sub_ranks
from .interceptor import Interceptor, THREAD, wrapped

_PG = getattr(dist, "ProcessGroup", None)
_GUARD = torch._C._AutoDispatchBelowADInplaceOrView


def _one_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _reduce_op(args, kwargs, i):
    o = args[i] if len(args) > i else kwargs.get("opts", kwargs.get("op"))
    return "SUM" if o is None else getattr(o, "reduceOp", o)


def _door_allreduce(args, kwargs):
    # allreduce(tensors, opts) | (tensors, op, timeout) | (tensor, op, timeout); one tensor only
    t = _one_tensor(args[0] if args else kwargs.get("tensors", kwargs.get("tensor")))
    return None if t is None else ("all_reduce", "c10d.allreduce_", t, t, _reduce_op(args, kwargs, 1))


def _out_in(args, kwargs):
    out = args[0] if args else kwargs.get("output", kwargs.get("outputTensor"))
    inp = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("inputTensor"))
    ok = isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)
    return (out, inp) if ok else (None, None)


def _door_gather(args, kwargs):
    # all_gather_single / _allgather_base (output, input, opts)
    out, inp = _out_in(args, kwargs)
    return None if out is None else ("all_gather", "c10d._allgather_base_", inp, out, "CAT")


def _door_scatter(args, kwargs):
    # reduce_scatter_single / _reduce_scatter_base (outputTensor, inputTensor, opts)
    out, inp = _out_in(args, kwargs)
    return None if out is None else ("reduce_scatter", "c10d._reduce_scatter_base_", inp, out,
                                     _reduce_op(args, kwargs, 2))


_READERS = {"allreduce": _door_allreduce, "all_gather_single": _door_gather, "_allgather_base": _door_gather,
            "reduce_scatter_single": _door_scatter, "_reduce_scatter_base": _door_scatter}


def _door(raw, read):
    def door(self, *args, **kwargs):
        st = getattr(THREAD, "stack", None)
        if not st:                          # nothing to record on this thread: skip the kernel's hop
            with _GUARD():
                return raw(self, *args, **kwargs)
        what = read(args, kwargs)
        if what is None or type(what[2]) is not torch.Tensor and wrapped((what[2],)):
            return raw(self, *args, **kwargs)   # the kernel's (a list form; a subclass passes through)
        a = st[-1]
        kind, path, inp, out, op = what
        if a.active_record is not None:     # inside a wrapper's record: the op is part of it
            a.active_record.via.append(path)
            with _GUARD():
                return raw(self, *args, **kwargs)
        rec = a.begin(kind, path, inp, self.size(), op)
        rec.group_ranks = sub_ranks(self, rec.group_size)
        with _GUARD():
            work = raw(self, *args, **kwargs)
        if work is not None:
            work.wait()
        a.end(rec, out)
        return work
    door.__wrapped__ = raw
    door._tpprobe_door = True
    return door


class Doors:
    """ProcessGroup's wrapped methods, process-wide: opened with the kernels, closed on release."""

    def __init__(self):
        self.wanted = knob("TPPROBE_AUDIT_DOORS") != "0"
        self.opened: dict[str, Any] = {}     # ProcessGroup method -> its own binding, while wrapped
        self.native: Any = None              # allreduce's door in C, while it is the open one

    def open(self) -> None:
        """Wrap ProcessGroup's Python methods (see `_door`); once, until `close`."""
        if self.opened or _PG is None:
            return
        for name, read in _READERS.items():
            raw = _PG.__dict__.get(name)
            if raw is None or getattr(getattr(_PG, name), "_tpprobe_door", False):
                continue
            self.opened[name] = raw
            setattr(_PG, name, _door(getattr(_PG, name), read))

    def to_native(self) -> Optional[Any]:
        """allreduce's door in C (fingerprint/triton/native.c's `Door`: the one form a decode forward
        issues recorded there, every other call handed to the Python door it wraps), once that module
        is built in this process (a fingerprint batch on a GPU builds it); the door in place, else None."""
        if self.native is not None or "allreduce" not in self.opened:
            return self.native
        mod = getattr(sys.modules.get("tpprobe.fingerprint.triton.native"), "NATIVE", None)
        py = _PG.__dict__.get("allreduce")
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if mod is None or raw_stream is None or not getattr(py, "_tpprobe_door", False) or \
                not hasattr(py, "__wrapped__"):
            return None
        self.native = mod.Door(py.__wrapped__, py, THREAD, torch.Tensor, _GUARD, raw_stream)
        setattr(_PG, "allreduce", self.native)
        return self.native

    def close(self) -> None:
        for name, raw in self.opened.items():
            if getattr(getattr(_PG, name, None), "_tpprobe_door", False):
                setattr(_PG, name, raw)
        self.opened = {}
        self.native = None


DOORS = Doors()   # process-wide by nature: ProcessGroup's methods are one class's; close() puts them back


class DoorsPath(Interceptor):
    """The doors, open while the kernel path watches (they read the same thread's Audit stack)."""
    name = "doors"

    def __init__(self, doors: Doors = DOORS):
        self.doors = doors

    def enter(self, audit) -> None:
        self.doors.open()
        self.doors.to_native()

    def exit(self, audit) -> None:
        pass                     # kept open, as the kernels are kept registered (`release` closes both)
