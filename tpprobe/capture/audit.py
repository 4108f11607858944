"""The collective audit: every reduce a rank issues during the forward, recorded once, where it runs.

Models reach the collective through many doors: `torch.distributed.all_reduce` (or the same
function imported under another name before the probe started), the process group object, the
functional collectives gpt-fast calls from forward hooks (`_c10d_functional.all_reduce` +
`wait_tensor`), sequence-parallel `reduce_scatter_tensor` + `all_gather_into_tensor`, SGLang's
`GroupCoordinator`. Every door that ends in c10d goes through the dispatcher as one of a few ops
(`c10d.allreduce_`, `c10d._reduce_scatter_base_`, `c10d._allgather_base_`, the `_c10d_functional`
ones), so `Audit` watches the dispatcher (a `TorchDispatchMode` that passes every other op
straight through) rather than Python attributes. Patching `torch.distributed.all_reduce` sees
none of the aliased, functional or process-group calls.

What it cannot read, it still counts and names: any op whose name says it is a collective
(`torch.ops.sglang.inplace_all_reduce`, `sgl_kernel.shm_allreduce`, a custom all-reduce kernel,
the list forms `c10d.allgather_` / `c10d.reduce_scatter_`) becomes a record with `checked=False`
and its op name as `path`; the coverage check reports each such path. Collectives that never
reach the dispatcher (pynccl through ctypes, symmetric memory) are invisible here: a layer-level
wrapper must record them with `Audit.collective` (below), else the reduce counts show the gap.

Records (`CollectiveRecord`) carry the kind (all_reduce | reduce_scatter | all_gather | unknown),
the path (which door), the issuing module and layer (from the Tap's module stack), the group size,
and the input before / output after (copies, or fingerprints with `summarize`).

Adding a door at a higher level (the API other layers use, e.g. SGLang's GroupCoordinator):

    with tap.audit.collective("all_reduce", "sglang.GroupCoordinator.all_reduce", inp=x,
                              group_size=gc.world_size) as rec:
        out = original(gc, x)
        rec.output(out)           # the reduced tensor (in-place reduces: the input itself)

Inside that block the dispatcher-level audit records nothing of its own (a re-entrancy guard):
the c10d op it sees is appended to `rec.via`, so one reduce is counted once, with its whole path.

How the dispatcher is watched (two paths, chosen when an Audit starts; both record the same ops,
decided by `audited(namespace, name)`, into the same records):

- the kernel path (the usual one): a Python kernel at the `ADInplaceOrView` dispatch key of exactly
  the audited ops (enumerated from `torch._C._dispatch_get_all_op_names()`). Every other op runs
  with no Python of ours at all (a TorchDispatchMode ran ~15 us of Python per aten op: 4 ms of a
  2.7 ms decode forward on an H200). The kernel hands the op to the Audit active on ITS thread (a
  thread-local stack), else passes it straight through (below ADInplaceOrView, which is where the
  key's fallthrough would have sent it: nothing changes for other threads). ADInplaceOrView, not
  Autograd: the key comes after every autograd kernel, so an op's own autograd kernel (torch 2.13
  registers one for `_c10d_functional.all_reduce` & co. once `torch.distributed._functional_collectives`
  is imported) is neither overridden nor lost, no override warning is printed, and backward still
  works. It sees an op whenever a tensor argument is not an inference tensor: with or without
  grad, and under `torch.inference_mode()` for tensors made outside it. A model compiled with
  torch.compile is compiled under it (a dispatch mode made dynamo run it eagerly): the fake tensors
  of the tracing are passed through unrecorded, the compiled graph's collectives are recorded.
  Registered once per process, on the first Audit, and kept (`release()` removes them when a
  long-lived process is done auditing: the SGLang plugin after its last captured step): measured on the 2-core dev
  CPU, torch 2.13, the first registration takes 5.2 ms (the scan of the 3600 op names 1.5 ms,
  registering the 36 audited ops 3.7 ms; removing them 0.06 ms), more than a whole 2.7 ms H200
  decode forward, so per forward (or refcounted per Audit) it is out. At each Audit start the ops
  registered since (an extension imported, a torch.library definition) are picked up: the scan
  re-runs only when `sys.modules`, `torch.ops.loaded_libraries` or `torch.library._defs` grew
  (0.4 us to check). Not seen by that check: a C++ library loaded by hand with ctypes; call
  `_doors.sync(force=True)` after one.
  Ops that decompose (CompositeImplicitAutograd: the legacy `c10d_functional` namespace) are not
  taken: the ops they decompose into are. An audited op that already has an ADInplaceOrView kernel
  is never overridden: while one exists, Audits take the mode path.
- ProcessGroup's doors (with the kernel path): the kernel costs every collective a hop into Python
  and back (the dispatcher boxes the op's TorchBind arguments, the kernel calls the op again: ~60 us
  on the 2-core dev CPU, twice the bare all-reduce), so while the kernels are registered the
  ProcessGroup methods most collectives come through (`allreduce`, the tensor forms of all-gather
  and reduce-scatter, which `dist.all_reduce`, `all_gather_into_tensor` and `reduce_scatter_tensor`
  call) are wrapped: the wrapper records the same record the kernel would, under the same op's
  name, and runs the method below ADInplaceOrView, where the kernel is not called (see `_door`).
  Every other door still reaches the kernel. `TPPROBE_AUDIT_DOORS=0` leaves them closed.
- the mode path (the fallback): a `TorchDispatchMode` that sees every op and passes all but the
  audited ones straight through. Taken when the Audit starts under `torch.inference_mode()` (what
  the forward makes there are inference tensors, which carry no ADInplaceOrView key), when the
  caller says its tensors may be inference tensors (`use_mode=True`: the Tap sets it when a
  parameter or buffer of the model is one), and when an audited op has its own ADInplaceOrView
  kernel (a mutating `torch.library.custom_op` registers one: such an op named like a collective
  sends every Audit here; `Audit.path` says why). What the kernel path cannot see and the mode
  can: a collective on an inference tensor the
  model does not hold (a buffer allocated under inference mode elsewhere) issued outside inference
  mode; a forward that enters inference mode itself after the Audit started. The mode keeps
  PyTorch's dynamo guard around `__torch_dispatch__` (`_should_skip_dynamo` stays True): without
  it dynamo would try to compile the mode's frame when a compiled region runs under the mode, which
  is not safe to claim for a frame that appends records and reads the clock; the fallback is rare,
  so its cost matters less.
"""
from __future__ import annotations

import importlib
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.knobs import knob
from .points import allreduce_in, allreduce_out

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "unknown")
REDUCES = ("all_reduce", "reduce_scatter", "unknown")       # kinds that sum partial results
_OPS = {int(v): k for k, v in dist.ReduceOp.RedOpType.__members__.items()}
_PASS = frozenset(("aten", "prim", "prims", "quantized", "_c10d_functional_autograd"))
_HINTS = ("all_reduce", "allreduce", "reduce_scatter", "reducescatter", "all_gather", "allgather", "alltoall",
          "all_to_all")
# c10d ops that move data without summing partial results: not part of the reduce audit
_NOT_REDUCE = frozenset(("broadcast_", "barrier", "send", "recv_", "recv_any_source_", "monitored_barrier_",
                         "gather_", "scatter_", "wait_tensor",
                         "_wrap_tensor_autograd", "broadcast",
                         # point-to-point, and the NaN check NCCL runs before a collective
                         # (TORCH_NCCL_NAN_CHECK=1): none is a collective of its own
                         "isend", "irecv", "batch_p2p_ops", "check_for_nan"))


@dataclass
class CollectiveRecord:
    seq: int
    module: str                     # innermost hooked module running when it was issued
    source: Optional[str]           # row-parallel module whose output it reduced, if known
    layer: Optional[int]            # decoder layer index, None outside layers
    where: str                      # "embed" | "layer.K" | "other"
    shape: tuple
    dtype: str
    group_size: int
    op: Any                         # "SUM", ...; or the op's ReduceOp as the collective got it, named
                                    # by meta() (a TorchBind call per collective, off the hot path)
    kind: str = "all_reduce"        # all_reduce | reduce_scatter | all_gather | unknown
    path: str = "c10d.allreduce_"   # the door it came through (op name or wrapper)
    via: list = field(default_factory=list)   # lower-level ops seen inside an outer record
    checked: bool = True            # False: the tensors could not be read (counted only)
    group: Optional[str] = None     # the issuing group's name when a wrapper knows it (SGLang: tp:0, attention_tp:0)
    group_ranks: Optional[list] = None   # its global ranks when not the whole world (a sub-group reduce)
    splits: Optional[list] = None   # an all-to-all's [output split sizes, input split sizes] ([] = equal chunks)
    inp: Optional[torch.Tensor] = None     # copy of the input (kept points only)
    out: Optional[torch.Tensor] = None
    inp_summary: Any = None
    out_summary: Any = None
    seconds: float = 0.0
    t0: float = 0.0                 # when it was issued (perf_counter), for `seconds`

    def meta(self) -> dict:
        return {"seq": self.seq, "module": self.module, "source": self.source, "layer": self.layer,
                "where": self.where, "shape": list(self.shape), "dtype": self.dtype,
                "group_size": self.group_size, "op": _op_name(self.op), "kind": self.kind,
                "path": "+".join([self.path] + list(dict.fromkeys(self.via))), "checked": self.checked,
                "group": self.group, "group_ranks": self.group_ranks,
                **({"splits": self.splits} if self.splits is not None else {})}

    # an outer-level wrapper hands the result here
    def output(self, t: Optional[torch.Tensor]) -> None:
        self._out = t


_DTYPES: dict = {}


def _dtype_name(t: torch.Tensor) -> str:
    d = t.dtype
    n = _DTYPES.get(d)
    if n is None:
        n = _DTYPES[d] = str(d).replace("torch.", "")
    return n


def audited(ns: str, name: str) -> bool:
    """Whether the op `ns::name` is a collective the audit records (read, or counted and named)."""
    if ns in _PASS:
        return False
    if ns in ("c10d", "_c10d_functional"):
        return name not in _NOT_REDUCE
    low = name.lower()
    return any(h in low for h in _HINTS)


class _Mode(TorchDispatchMode):
    def __init__(self, audit: "Audit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _PASS:
            return func(*args, **kwargs)
        return self.audit._dispatch(func, args, kwargs)


_local = threading.local()        # .stack: the Audits active on this thread (kernel path)
_KEY = "ADInplaceOrView"


def _active_stack() -> list:
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


_PYKEY = torch._C.DispatchKey.Python


def _wrapped(args) -> bool:
    """Whether the op's first tensor is a Python-dispatched one (a FakeTensor while torch.compile
    traces, a FunctionalTensor, a subclass): no collective runs here; the subclass's own handling
    issues the real one on plain tensors, and that is the one recorded."""
    for a in args:
        t = a if isinstance(a, torch.Tensor) else \
            a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else None
        if t is not None:
            return type(t) is not torch.Tensor and torch._C._dispatch_keys(t).has(_PYKEY)
    return False


def _kernel(op):
    def k(*args, **kwargs):
        # below the key: the op (and whatever the audit runs around it) never comes back here
        with torch._C._AutoDispatchBelowADInplaceOrView():
            st = getattr(_local, "stack", None)
            if st and not _wrapped(args):
                return st[-1]._dispatch(op, args, kwargs)
            return op(*args, **kwargs)
    return k


# -- the process group's own doors --------------------------------------------------------------
# The kernel costs a hop into Python and back for every collective, audited or not: the dispatcher
# boxes the op's arguments (the process group and the reduce op are TorchBind objects), calls the
# kernel, and the kernel calls the op again, which unboxes them: ~60 us on the 2-core dev CPU,
# twice the bare all-reduce (bench/collective_split.py). Most collectives come through
# ProcessGroup's Python methods (`dist.all_reduce` calls `group.allreduce`, the tensor forms of
# all-gather and reduce-scatter theirs), so those methods are wrapped while the kernels are
# registered: the wrapper records what the kernel would have, in the same record, and runs the
# method below ADInplaceOrView, where the kernel is not called. Every other door (a direct
# `torch.ops.c10d` call, the functional collectives, SGLang's custom ops, the list forms) still
# goes through the kernel.
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


_DOORS = {"allreduce": _door_allreduce, "all_gather_single": _door_gather, "_allgather_base": _door_gather,
          "reduce_scatter_single": _door_scatter, "_reduce_scatter_base": _door_scatter}


def _door(raw, read):
    def door(self, *args, **kwargs):
        st = getattr(_local, "stack", None)
        if not st:                          # nothing to record on this thread: skip the kernel's hop
            with _GUARD():
                return raw(self, *args, **kwargs)
        what = read(args, kwargs)
        if what is None or _wrapped((what[2],)):
            return raw(self, *args, **kwargs)   # the kernel's (a list form; a subclass passes through)
        a = st[-1]
        kind, path, inp, out, op = what
        if a._active is not None:           # inside a wrapper's record: the op is part of it
            a._active.via.append(path)
            with _GUARD():
                return raw(self, *args, **kwargs)
        rec = a.begin(kind, path, inp, self.size(), op)
        rec.group_ranks = _sub_ranks(self, rec.group_size)
        with _GUARD():
            work = raw(self, *args, **kwargs)
        if work is not None:
            work.wait()
        a.end(rec, out)
        return work
    door.__wrapped__ = raw
    door._tpprobe_door = True
    return door


class _Doors:
    """The process-wide registration of the audit's kernels (see the module docstring)."""

    def __init__(self):
        self.libs: dict[str, Any] = {}
        self.done: set[str] = set()          # op names ("ns::name.overload") with our kernel
        self.own: set[str] = set()           # audited ops with their own kernel at the key (mode path)
        self.skipped: set[str] = set()       # decomposing ops (their parts are audited)
        self.stamp = None
        self.lock = threading.Lock()
        self.scans = 0
        self.active = 0                      # Audits on the kernel path, every thread
        self.doors: dict[str, Any] = {}      # ProcessGroup method -> its own binding, while wrapped
        self.want_doors = knob("TPPROBE_AUDIT_DOORS") != "0"

    @staticmethod
    def _stamp():
        import torch.library
        return (len(sys.modules), len(getattr(torch.ops, "loaded_libraries", ())),
                len(getattr(torch.library, "_defs", ())))

    def sync(self, force: bool = False) -> bool:
        """Register the kernel on every audited op not yet seen; True when the kernel path is sound
        (no audited op keeps its own kernel at the key)."""
        stamp = self._stamp()
        if stamp == self.stamp and not force:
            return not self.own
        with self.lock:
            self.stamp = stamp
            self.scans += 1
            has = torch._C._dispatch_has_kernel_for_dispatch_key
            for full in torch._C._dispatch_get_all_op_names():
                if full in self.done or full in self.own or full in self.skipped:
                    continue
                ns, _, rest = full.partition("::")
                name, _, overload = rest.partition(".")
                if not audited(ns, name):
                    continue
                if has(full, "CompositeImplicitAutograd"):
                    self.skipped.add(full)
                    continue
                if has(full, _KEY):
                    self.own.add(full)
                    continue
                try:
                    op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
                    lib = self.libs.get(ns)
                    if lib is None:
                        lib = self.libs[ns] = torch.library.Library(ns, "IMPL")
                    lib.impl(rest, _kernel(op), _KEY)
                    self.done.add(full)
                except Exception:          # cannot be registered: the mode must watch it
                    self.own.add(full)
            if self.want_doors:
                self._open_doors()
        return not self.own

    def set_doors(self, on: bool) -> None:
        """ProcessGroup's doors on (the default) or off: off, every collective goes through the
        kernel (a diagnostic; TPPROBE_AUDIT_DOORS=0 starts a process with them off)."""
        with self.lock:
            self.want_doors = on
            if on and self.libs:
                self._open_doors()
            elif not on:
                self._close_doors()

    def _open_doors(self) -> None:
        """Wrap ProcessGroup's Python methods (see `_door`); once, until `release`."""
        if self.doors or _PG is None:
            return
        for name, read in _DOORS.items():
            raw = _PG.__dict__.get(name)
            if raw is None or getattr(getattr(_PG, name), "_tpprobe_door", False):
                continue
            self.doors[name] = raw
            setattr(_PG, name, _door(getattr(_PG, name), read))

    def _close_doors(self) -> None:
        for name, raw in self.doors.items():
            if getattr(getattr(_PG, name, None), "_tpprobe_door", False):
                setattr(_PG, name, raw)
        self.doors = {}

    def release(self) -> bool:
        """Remove every kernel (0.06 ms), so collectives run with no Python of ours again; a later
        Audit registers them anew (5 ms). For a long-lived process that audits a few forwards and
        then none (the SGLang plugin after its last captured step): without it each later
        collective pays the kernel's pass-through (a few us: ~120 per decode step of a 61-layer
        model). Refused (False) while an Audit is active on any thread."""
        with self.lock:
            if self.active:
                return False
            for lib in self.libs.values():
                lib._destroy()
            self._close_doors()
            self.libs, self.done, self.stamp = {}, set(), None
            return True


_doors = _Doors()


def release() -> bool:
    """The audit's kernels off until the next Audit (see `_Doors.release`)."""
    return _doors.release()


def holds_inference_tensors(model: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of the model is an inference tensor (made under inference
    mode): a collective on it would pass the kernels unseen, so the mode must watch."""
    return any(t.is_inference() for t in model.parameters()) or any(t.is_inference() for t in model.buffers())


def prepare(model: Optional[torch.nn.Module] = None) -> None:
    """Called before the ranks agree to start the forward, so no rank's forward (and no peer's
    collective timeout) waits on another rank's one-off work: registers the audit's kernels (5 ms
    the first time), and, when the mode path will watch (inference mode, a model holding inference
    tensors, or no model given), imports what the dispatch mode's first op imports (torch._dynamo:
    about 1 s alone, 8 s on a loaded 2-core box)."""
    if _doors.sync() and model is not None and not torch.is_inference_mode_enabled() \
            and not holds_inference_tensors(model):
        return
    importlib.import_module("torch._dynamo")


def _group_size_of(pg) -> int:
    try:
        return dist.ProcessGroup.unbox(pg).size()
    except Exception:
        return -1


def _sub_ranks(pg, size: int) -> Optional[list]:
    """The global ranks of a sub-group collective (None for the whole world, or when unknown): the
    check sums over these ranks only. Asked only when the group is smaller than the world."""
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


def _named_group_size(name: str) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(name).size()
    except Exception:
        return -1


def _op_name(op) -> str:
    if isinstance(op, str):
        return op.upper()
    try:
        if isinstance(op, dist.ReduceOp.RedOpType):       # a door's op (Python binding)
            return _OPS.get(int(op), str(op))
        if isinstance(op, dist.ReduceOp):
            return _OPS.get(int(op.op), str(op))
        return _OPS.get(int(op.op()), str(op))           # the dispatcher's (TorchBind)
    except Exception:
        return str(op).split(".")[-1]


_Work = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None)


def _wait(result):
    """Wait for the work a c10d op returned (below the op's Python binding it is the TorchBind
    ScriptObject, not the Python Work): through the Python Work it boxes, ``Work.unbox``. Calling
    ``wait`` on the ScriptObject itself crashed the process on a NCCL work (segmentation fault,
    torch 2.11 + NCCL 2.28 on an H200; gloo's did not): that is how the 2-GPU runs' NCCL ranks
    died without a word."""
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


class Audit:
    """Records every collective issued while it is active (a context manager).

    attribute(tensor) -> (module, layer, where, source) places a collective in the model (the Tap's
    module stack); keep(where) says whether to copy its tensors; summarize(t) fingerprints them."""

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
        self._active: Optional[CollectiveRecord] = None     # the re-entrancy guard
        self._mode: Optional[_Mode] = None
        self._stack: Optional[list] = None
        self.path = ""                   # "kernel" | "mode (why)": how this Audit watched (module docstring)
        # True: watch through the TorchDispatchMode (the caller's tensors may be inference tensors)
        self.use_mode = use_mode
        self._observers: OrderedDict = OrderedDict()     # observe(): called as each collective begins

    # -- on / off -------------------------------------------------------------------------------
    def __enter__(self) -> "Audit":
        why = ("the tensors may be inference tensors" if self.use_mode else
               "inference mode" if torch.is_inference_mode_enabled() else
               "" if _doors.sync() else "own ADInplaceOrView kernel: " + ", ".join(sorted(_doors.own)))
        if why:
            self.path = f"mode ({why})"
            self._mode = _Mode(self)
            self._mode.__enter__()
        else:
            self.path = "kernel"
            self._stack = _active_stack()
            self._stack.append(self)
            with _doors.lock:
                _doors.active += 1
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            st, self._stack = self._stack, None
            if st and st[-1] is self:
                st.pop()
            elif self in st:
                st.remove(self)
            with _doors.lock:
                _doors.active -= 1
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc)

    # -- the one way to record a collective ------------------------------------------------------
    def begin(self, kind: str, path: str, inp: Optional[torch.Tensor], group_size: int, op: str = "SUM",
              checked: bool = True, splits: Optional[list] = None) -> CollectiveRecord:
        if self.before is not None:
            self.before(inp)
        module, layer, where, source = self.attribute(inp)
        t = inp if isinstance(inp, torch.Tensor) else None
        rec = CollectiveRecord(len(self.records), module, source, layer, where,
                               tuple(t.shape) if t is not None else (), _dtype_name(t) if t is not None else "?",
                               group_size, op, kind, path, [], checked and t is not None)
        rec.splits = splits
        if rec.checked:
            if self.keep(where):
                rec.inp = self.copy(allreduce_in(rec.seq), t, where)
            if self.summarize is not None:
                rec.inp_summary = self._summ(t, kind, group_size, is_input=True, splits=rec.splits)
        self.records.append(rec)
        if self.progress is not None:
            self.progress.collective = {"seq": rec.seq, "module": module, "where": where,
                                        "shape": list(rec.shape), "since": time.time(), "kind": kind}
        for fn in tuple(self._observers.values()) if self._observers else ():
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
            self.progress.collective = None
        if self.after is not None:
            self.after(rec, out)
        if not rec.checked or not isinstance(out, torch.Tensor):
            rec.checked = rec.checked and isinstance(out, torch.Tensor)
            return
        if self.keep(rec.where) and rec.inp is not None:
            rec.out = self.copy(allreduce_out(rec.seq), out, rec.where)
            if rec.out is None:
                rec.inp = None            # both or neither: the budget refused the output
        if self.summarize is not None:
            rec.out_summary = self._summ(out, rec.kind, rec.group_size, is_input=False, splits=rec.splits)

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

    @contextmanager
    def collective(self, kind: str, path: str, inp: Optional[torch.Tensor], group_size: int, op: str = "SUM"):
        """For wrappers above c10d (SGLang's GroupCoordinator, a custom all-reduce): record one
        collective; the c10d ops it issues inside are folded into it (`via`), not counted again.
        Call `rec.output(tensor)` with the result; without it the input (an in-place reduce) is read."""
        if self._active is not None:          # nested wrapper: the outer record already counts it
            self._active.via.append(path)
            yield self._active
            return
        rec = self.begin(kind, path, inp, group_size, op)
        rec._out = None
        self._active = rec
        try:
            yield rec
        finally:
            self._active = None
        self.end(rec, rec._out if rec._out is not None else inp)

    # -- the dispatcher door ------------------------------------------------------------------------
    def _dispatch(self, func, args, kwargs):
        ns, name = func.namespace, func._opname
        key = f"{ns}.{name}"
        if not audited(ns, name):
            return func(*args, **kwargs)
        if self._active is not None:
            self._active.via.append(key)
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
        rec = a.begin("all_reduce", "c10d.allreduce_", tensors[0] if tensors else None, _group_size_of(pg),
                      op, checked=False)
        res = func(*args, **kwargs)
        _wait(res)
        a.end(rec, None)
        return res
    rec = a.begin("all_reduce", "c10d.allreduce_", tensors[0], _group_size_of(pg), op)
    rec.group_ranks = _sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    _wait(res)
    a.end(rec, tensors[0])
    return res


def _fn_allreduce(a: Audit, func, args, kwargs):
    inp, op, group = args[0], args[1], args[2]
    rec = a.begin("all_reduce", f"_c10d_functional.{func._opname}", inp, _named_group_size(group), op)
    rec.group_ranks = _sub_ranks(group, rec.group_size)
    out = func(*args, **kwargs)
    torch.ops._c10d_functional.wait_tensor(out)
    a.end(rec, out)
    return out


def _c10d_reduce_scatter(a: Audit, func, args, kwargs):
    out, inp, pg, op = args[0], args[1], args[2], args[3]
    rec = a.begin("reduce_scatter", "c10d._reduce_scatter_base_", inp, _group_size_of(pg), op)
    rec.group_ranks = _sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    _wait(res)
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
    rec = a.begin("all_gather", "c10d._allgather_base_", inp, _group_size_of(pg), "CAT")
    rec.group_ranks = _sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    _wait(res)
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
    rec = a.begin("all_to_all", "c10d.alltoall_base_", inp, _group_size_of(pg), "PERMUTE",
                  splits=[[int(x) for x in out_splits], [int(x) for x in in_splits]])
    rec.group_ranks = _sub_ranks(pg, rec.group_size)
    res = func(*args, **kwargs)
    _wait(res)
    a.end(rec, out)
    return res


def _fn_alltoall(a: Audit, func, args, kwargs):
    inp, out_splits, in_splits, group = args[0], args[1], args[2], args[3]
    rec = a.begin("all_to_all", "_c10d_functional.all_to_all_single", inp, _named_group_size(group), "PERMUTE",
                  splits=[[int(x) for x in out_splits], [int(x) for x in in_splits]])
    rec.group_ranks = _sub_ranks(group, rec.group_size)
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


def _reduce(ins: list[torch.Tensor], op: str) -> Optional[torch.Tensor]:
    """The reduction `op` of the inputs, in float64 (None for an op without a definition here)."""
    xs = [t.double() for t in ins]
    if op == "SUM":
        return sum(xs)
    if op == "AVG":
        return sum(xs) / len(xs)
    if op == "MAX":
        return torch.stack(xs).amax(0)
    if op == "MIN":
        return torch.stack(xs).amin(0)
    if op == "PRODUCT":
        return torch.stack(xs).prod(0)
    return None


def a2a_chunks(t: torch.Tensor, splits: Optional[list], world: int, is_input: bool) -> Optional[list]:
    """An all-to-all's input cut by destination rank, or its output by source rank (dim 0, by the
    split sizes it was given; none: equal chunks); None when the sizes do not fit the tensor."""
    sizes = list((splits or [[], []])[1 if is_input else 0])
    if not sizes:
        if world <= 0 or not t.dim() or t.shape[0] % world:
            return None
        sizes = [t.shape[0] // world] * world
    if not t.dim() or sum(sizes) != t.shape[0] or len(sizes) != world:
        return None
    return list(t.split(sizes, 0))


def expected_output(kind: str, ins: list[torch.Tensor], rank: int, world: int,
                    op: str = "SUM", splits: Optional[list] = None) -> Optional[torch.Tensor]:
    """What a complete collective returns on `rank`, from every rank's input (float64), by its
    own definition: the reduction `op` (SUM, AVG, MAX, MIN, PRODUCT); a reduce-scatter's `rank`-th
    slice of it; an all-gather's concatenation; an all-to-all's chunk `rank` of every rank's input,
    in rank order (`splits`: each member's [output, input] split sizes, in member order)."""
    if kind == "all_to_all":
        parts = []
        for q, t in enumerate(ins):
            chunks = a2a_chunks(t, (splits or [None] * len(ins))[q], world, is_input=True)
            if chunks is None:
                return None
            parts.append(chunks[rank].double())
        return torch.cat(parts, 0)
    if kind == "all_reduce":
        return _reduce(ins, op)
    if kind == "reduce_scatter":
        total = _reduce(ins, op)
        return total.chunk(world, 0)[rank] if total is not None and total.dim() and total.shape[0] % world == 0 \
            else None
    if kind == "all_gather":
        return torch.cat([t.double() for t in ins], 0)
    return None
