"""`Audit`: records every collective issued while it is active, through the interception paths it picks at start."""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from ..points import allreduce_in, allreduce_out
from . import wrappers
from .c10d import group_size_of, named_group_size, sub_ranks, wait
from .doors import DOORS, DoorsPath
from .kernel import KERNELS, KernelPath
from .mode import ModePath
from .records import DTYPE_NAMES, CollectiveRecord, a2a_chunks, audited, dtype_name

# the fields allreduce's door in C sets on a record, in CollectiveRecord's order (native.c new_record)
RECORD_FIELDS = ("seq", "module", "source", "layer", "where", "shape", "dtype", "group_size", "op", "kind", "path",
                 "via", "checked", "group", "group_ranks", "splits", "inp", "out", "inp_summary", "out_summary",
                 "seconds", "t0", "_out")


# ops ("ns.name") whose Python implementation runs a wrapper's door (an engine's custom all-reduce op that
# calls its coordinator: vLLM's torch.ops.vllm.all_reduce): the door records the call, the dispatcher lets
# it through. Counted per registration; only while the door that records them is open (`door_below`).
BELOW: dict = {}


class _Below:
    def __init__(self, key: str):
        self.key = key
        BELOW[key] = BELOW.get(key, 0) + 1

    def remove(self) -> None:
        if self.key is not None:
            n = BELOW.get(self.key, 0) - 1
            if n > 0:
                BELOW[self.key] = n
            else:
                BELOW.pop(self.key, None)
            self.key = None


def door_below(key: str) -> _Below:
    """Register op `key` ("ns.name") as recorded by a wrapper's door its implementation reaches; the
    returned handle's `remove()` ends it (with the door)."""
    return _Below(key)


def sync(force: bool = False) -> bool:
    """Register the audit's kernels on every audited op not yet seen, and open ProcessGroup's doors
    where wanted; True when the kernel path is sound (no audited op keeps its own kernel)."""
    ok = KERNELS.sync(force)
    if DOORS.wanted and KERNELS.registered():
        DOORS.open()
    return ok


def set_doors(on: bool) -> None:
    """ProcessGroup's doors on (the default) or off: off, every collective on the kernel path goes
    through the kernel (a diagnostic; TPPROBE_AUDIT_DOORS=0 starts a process with them off)."""
    with KERNELS.lock:
        DOORS.wanted = on
        if on and KERNELS.registered():
            DOORS.open()
        elif not on:
            DOORS.close()


def release() -> bool:
    """The audit's kernels and doors off until the next Audit, so collectives run with no Python of
    ours (the plugins after their last captured step); refused (False) while an Audit is active."""
    if not KERNELS.release():
        return False
    DOORS.close()
    return True


class Audit:
    """Records every collective issued while it is active (a context manager).

    attribute(tensor) -> (module, layer, where, source) places a collective in the model (the Tap's
    module stack); keep(where) says whether to copy its tensors; summarize(t) fingerprints them.
    ``path`` says how it watched: "kernel" (the dispatcher kernels, with ProcessGroup's doors where
    open) or "mode (why)" (the dispatch mode); ``paths`` names every interceptor it entered."""

    def __init__(self, attribute: Callable, keep: Callable[[str], bool] = lambda where: True,
                 summarize: Optional[Callable] = None, progress=None,
                 copy: Optional[Callable[[str, torch.Tensor], Optional[torch.Tensor]]] = None,
                 before: Optional[Callable[[Optional[torch.Tensor]], None]] = None,
                 after: Optional[Callable[["CollectiveRecord", Optional[torch.Tensor]], None]] = None,
                 use_mode: bool = False):
        self.attribute, self.keep, self.summarize, self.progress = attribute, keep, summarize, progress
        # before(inp): called before a collective is issued (may raise: the Tap's device-lag bound);
        # after(rec, out): called once it has completed on the host's side (the Tap's CUDA event)
        self.before, self.after = before, after
        # copy(name, t, where) -> a copy, or None when a byte budget refuses it (asked before copying)
        self.copy = copy or (lambda name, t, where: t.detach().clone())
        self.records: list[CollectiveRecord] = []
        self.active_record: Optional[CollectiveRecord] = None     # a wrapper's record (re-entrancy guard)
        self.interceptors: list = []
        self.path = ""
        self.paths: tuple = ()
        # True: watch through the TorchDispatchMode (the caller's tensors may be inference tensors)
        self.use_mode = use_mode
        self._observers: OrderedDict = OrderedDict()     # observe(): called as each collective begins
        # what allreduce's door in C records with (doors.Doors.to_native; `arm` builds it): None, the
        # Python door records every collective
        self.native: Optional[tuple] = None

    # -- on / off -------------------------------------------------------------------------------
    def __enter__(self) -> "Audit":
        why = ("the tensors may be inference tensors" if self.use_mode else
               "inference mode" if torch.is_inference_mode_enabled() else
               "" if sync() else "own ADInplaceOrView kernel: " + ", ".join(sorted(KERNELS.own)))
        if why:
            self.path = f"mode ({why})"
            chosen = [ModePath(why)]
        else:
            self.path = "kernel"
            chosen = [KernelPath()] + ([DoorsPath()] if DOORS.opened else [])
        for i in chosen:
            i.enter(self)
            self.interceptors.append(i)
        self.paths = tuple(i.name for i in chosen)
        return self

    def __exit__(self, *exc) -> None:
        self.native = None
        while self.interceptors:
            self.interceptors.pop().exit(self)

    def arm(self, event, record_event, stream) -> bool:
        """Let allreduce's door in C record this Audit's all-reduces (doors.Doors.to_native) as ``begin``
        and ``end`` would, with ``after`` being: a CUDA event (``event()``, ``record_event(ev, stream(device))``)
        appended to progress.events after the collective (the Tap's). Only on the doors path with that
        door in place, a progress to post to, and CollectiveRecord's fields as the door sets them."""
        if "doors" not in self.paths or DOORS.native is None or self.progress is None or record_event is None \
                or CollectiveRecord.__slots__ != RECORD_FIELDS:
            return False
        self.native = (self.attribute, self.keep, self.summarize, self.progress, self.records, self.before,
                       self.copy, allreduce_in, allreduce_out, CollectiveRecord, DTYPE_NAMES, dtype_name,
                       sub_ranks, event, record_event, stream, self._observers)
        return True

    # -- the one way to record a collective ------------------------------------------------------
    def begin(self, kind: str, path: str, inp: Optional[torch.Tensor], group_size: int, op: str = "SUM",
              checked: bool = True, splits: Optional[list] = None) -> CollectiveRecord:
        if self.before is not None:
            self.before(inp)
        module, layer, where, source = self.attribute(inp)
        if isinstance(inp, torch.Tensor):
            rec = CollectiveRecord(len(self.records), module, source, layer, where, tuple(inp.shape), dtype_name(inp),
                                   group_size, op, kind, path, [], checked)
        else:
            rec = CollectiveRecord(len(self.records), module, source, layer, where, (), "?", group_size, op, kind,
                                   path, [], False)
        rec.splits = splits
        if rec.checked:
            if self.keep(where):
                rec.inp = self.copy(allreduce_in(rec.seq), inp, where)
            if self.summarize is not None:
                rec.inp_summary = self.summarize(inp) if kind == "all_reduce" else \
                    self._summ(inp, kind, group_size, is_input=True, splits=splits)
        self.records.append(rec)
        if self.progress is not None:
            self.progress.issued = (rec, time.time())
        if self._observers:
            for fn in tuple(self._observers.values()):
                fn(rec, inp)
        rec.t0 = time.perf_counter()
        return rec

    def observe(self, fn: Callable[["CollectiveRecord", Any], None]):
        """Call fn(record, input) as each collective begins, once it is recorded (its input summarized;
        the output is filled in when it ends): for a caller that places the collectives among its
        own events (`tpprobe invariance`). Returns a handle whose `remove()` stops it."""
        from torch.utils.hooks import RemovableHandle
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = fn
        return handle

    def end(self, rec: CollectiveRecord, out: Optional[torch.Tensor]) -> None:
        rec.seconds = time.perf_counter() - rec.t0 if rec.t0 else 0.0
        if self.progress is not None:
            self.progress.issued = None
        if self.after is not None:
            self.after(rec, out)
        if not rec.checked or not isinstance(out, torch.Tensor):
            rec.checked = rec.checked and isinstance(out, torch.Tensor)
            return
        if rec.inp is not None and self.keep(rec.where):
            rec.out = self.copy(allreduce_out(rec.seq), out, rec.where)
            if rec.out is None:
                rec.inp = None            # both or neither: the budget refused the output
        if self.summarize is not None:
            rec.out_summary = self.summarize(out) if rec.kind == "all_reduce" else \
                self._summ(out, rec.kind, rec.group_size, is_input=False, splits=rec.splits)

    def _summ(self, t, kind, group_size, is_input, splits=None):
        # reduce-scatter inputs and all-gather outputs are checked chunk by chunk (dim 0, one per rank);
        # an all-to-all's input by destination and its output by source
        if kind == "all_reduce":
            return self.summarize(t)
        if kind == "all_to_all":
            parts = a2a_chunks(t, splits, group_size, is_input)
            return [self.summarize(c.contiguous()) for c in parts] if parts is not None else self.summarize(t)
        if (kind == "reduce_scatter" and is_input or kind == "all_gather" and not is_input) and group_size > 0 \
                and t.dim() and t.shape[0] % group_size == 0:
            return [self.summarize(c.contiguous()) for c in t.chunk(group_size, 0)]
        return self.summarize(t)

    def collective(self, kind: str, path: str, inp: Optional[torch.Tensor], group_size: int, op: str = "SUM"):
        """For wrappers above c10d: record one collective (see wrappers.py)."""
        return wrappers.collective(self, kind, path, inp, group_size, op)

    # -- the dispatcher's ops (the kernel and mode paths hand them here) -----------------------------
    def dispatch(self, func, args, kwargs):
        ns, name = func.namespace, func._opname
        key = f"{ns}.{name}"
        if not audited(ns, name):
            return func(*args, **kwargs)
        if self.active_record is not None:
            self.active_record.via.append(key)
            return func(*args, **kwargs)
        if key in BELOW:         # its implementation reaches a wrapper's door, which records it (once)
            return func(*args, **kwargs)
        handler = _HANDLERS.get(key)
        if handler is None:      # a collective we cannot read: counted and named, never skipped
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if t is None:
                t = next((a[0] for a in args if isinstance(a, (list, tuple)) and a
                          and isinstance(a[0], torch.Tensor)), None)
            low = name.lower()
            kind = "all_gather" if "gather" in low else "all_to_all" if "alltoall" in low or "all_to_all" in low \
                else "unknown"
            rec = self.begin(kind, key, t, -1, "?", checked=False)
            rec.shape = tuple(t.shape) if t is not None else ()
            try:
                return func(*args, **kwargs)
            finally:
                self.end(rec, None)
        return handler(self, func, args, kwargs)


def _c10d_allreduce(a: Audit, func, args, kwargs):
    tensors, pg, op = args[0], args[1], args[2]
    if len(tensors) != 1:
        rec = a.begin("all_reduce", "c10d.allreduce_", tensors[0] if tensors else None, group_size_of(pg),
                      op, checked=False)
        res = func(*args, **kwargs)
        wait(res)
        a.end(rec, None)
        return res
    rec = a.begin("all_reduce", "c10d.allreduce_", tensors[0], group_size_of(pg), op)
    rec.group_ranks = sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    wait(res)
    a.end(rec, tensors[0])
    return res


def _fn_allreduce(a: Audit, func, args, kwargs):
    inp, op, group = args[0], args[1], args[2]
    rec = a.begin("all_reduce", f"_c10d_functional.{func._opname}", inp, named_group_size(group), op)
    rec.group_ranks = sub_ranks(group, rec.group_size)
    out = func(*args, **kwargs)
    torch.ops._c10d_functional.wait_tensor(out)
    a.end(rec, out)
    return out


def _c10d_reduce_scatter(a: Audit, func, args, kwargs):
    out, inp, pg, op = args[0], args[1], args[2], args[3]
    rec = a.begin("reduce_scatter", "c10d._reduce_scatter_base_", inp, group_size_of(pg), op)
    rec.group_ranks = sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    wait(res)
    a.end(rec, out)
    return res


def _fn_reduce_scatter(a: Audit, func, args, kwargs):
    inp, op, group_size, _group = args[0], args[1], args[2], args[3]
    rec = a.begin("reduce_scatter", "_c10d_functional.reduce_scatter_tensor", inp, int(group_size), op)
    out = func(*args, **kwargs)
    torch.ops._c10d_functional.wait_tensor(out)
    a.end(rec, out)
    return out


def _c10d_all_gather(a: Audit, func, args, kwargs):
    out, inp, pg = args[0], args[1], args[2]
    rec = a.begin("all_gather", "c10d._allgather_base_", inp, group_size_of(pg), "CAT")
    rec.group_ranks = sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    wait(res)
    a.end(rec, out)
    return res


def _fn_all_gather(a: Audit, func, args, kwargs):
    inp, group_size = args[0], args[1]
    rec = a.begin("all_gather", "_c10d_functional.all_gather_into_tensor", inp, int(group_size), "CAT")
    out = func(*args, **kwargs)
    torch.ops._c10d_functional.wait_tensor(out)
    a.end(rec, out)
    return out


def _c10d_alltoall(a: Audit, func, args, kwargs):
    out, inp, pg, out_splits, in_splits = args[0], args[1], args[2], args[3], args[4]
    rec = a.begin("all_to_all", "c10d.alltoall_base_", inp, group_size_of(pg), "PERMUTE",
                  splits=[[int(x) for x in out_splits], [int(x) for x in in_splits]])
    rec.group_ranks = sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    wait(res)
    a.end(rec, out)
    return res


def _fn_alltoall(a: Audit, func, args, kwargs):
    inp, out_splits, in_splits, group = args[0], args[1], args[2], args[3]
    rec = a.begin("all_to_all", "_c10d_functional.all_to_all_single", inp, named_group_size(group), "PERMUTE",
                  splits=[[int(x) for x in out_splits], [int(x) for x in in_splits]])
    rec.group_ranks = sub_ranks(group, rec.group_size)
    out = func(*args, **kwargs)
    torch.ops._c10d_functional.wait_tensor(out)
    a.end(rec, out)
    return out


_HANDLERS = {
    "c10d.allreduce_": _c10d_allreduce,
    "_c10d_functional.all_reduce": _fn_allreduce,
    "_c10d_functional.all_reduce_": _fn_allreduce,
    "c10d._reduce_scatter_base_": _c10d_reduce_scatter,
    "_c10d_functional.reduce_scatter_tensor": _fn_reduce_scatter,
    "c10d._allgather_base_": _c10d_all_gather,
    "_c10d_functional.all_gather_into_tensor": _fn_all_gather,
    "c10d.alltoall_base_": _c10d_alltoall,
    "_c10d_functional.all_to_all_single": _fn_alltoall,
}
