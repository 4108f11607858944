"""The kernel path: a Python kernel at ``ADInplaceOrView`` on exactly the audited ops, registered once per process.

Every other op runs with no Python of ours.  The kernel hands the op to the Audit active on ITS
thread, else passes it straight through below the key (where its fallthrough would have sent it).
ADInplaceOrView, not Autograd: the key comes after every autograd kernel, so an op's own autograd
kernel is neither overridden nor lost and backward still works.  It sees an op whenever a tensor
argument is not an inference tensor; a model compiled with torch.compile is compiled under it (the
fake tensors of the tracing pass unrecorded).  Registered on the first Audit and kept: registering
costs more than a decode forward (docs/benchmarks.md), so `release()` removes them when a long-lived
process is done auditing (the plugins after their last captured step).  At each Audit start the
ops registered since (an extension imported, a torch.library definition) are picked up; the scan
re-runs only when `sys.modules`, `torch.ops.loaded_libraries` or `torch.library._defs` grew (a C++
library loaded by hand with ctypes is not seen: `sync(force=True)` after one).  Ops that decompose
(CompositeImplicitAutograd) are not taken, their parts are; an audited op that already has an
ADInplaceOrView kernel is never overridden, and while one exists Audits take the mode path."""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from .interceptor import Interceptor, THREAD, active_stack, wrapped
from .records import audited

KEY = "ADInplaceOrView"


def _kernel(op):
    def k(*args, **kwargs):
        # below the key: the op (and whatever the audit runs around it) never comes back here
        with torch._C._AutoDispatchBelowADInplaceOrView():
            st = getattr(THREAD, "stack", None)
            if st and not wrapped(args):
                return st[-1].dispatch(op, args, kwargs)
            return op(*args, **kwargs)
    return k


class Kernels:
    """The process-wide registration of the audit's kernels."""

    def __init__(self):
        self.libs: dict[str, Any] = {}
        self.done: set[str] = set()          # op names ("ns::name.overload") with our kernel
        self.own: set[str] = set()           # audited ops with their own kernel at the key (mode path)
        self.skipped: set[str] = set()       # decomposing ops (their parts are audited)
        self.stamp = None
        self.lock = threading.Lock()
        self.scans = 0
        self.active = 0                      # Audits on the kernel path, every thread

    @staticmethod
    def _stamp():
        import torch.library
        return (len(sys.modules), len(getattr(torch.ops, "loaded_libraries", ())),
                len(getattr(torch.library, "_defs", ())))

    def registered(self) -> bool:
        return bool(self.libs)

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
                if has(full, KEY):
                    self.own.add(full)
                    continue
                try:
                    op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
                    lib = self.libs.get(ns)
                    if lib is None:
                        lib = self.libs[ns] = torch.library.Library(ns, "IMPL")
                    lib.impl(rest, _kernel(op), KEY)
                    self.done.add(full)
                except Exception:          # cannot be registered: the mode must watch it
                    self.own.add(full)
        return not self.own

    def release(self) -> bool:
        """Remove every kernel, so collectives run with no Python of ours again; a later Audit
        registers them anew.  Refused (False) while an Audit is active on any thread."""
        with self.lock:
            if self.active:
                return False
            for lib in self.libs.values():
                lib._destroy()
            self.libs, self.done, self.stamp = {}, set(), None
            return True


KERNELS = Kernels()   # process-wide by nature: dispatcher kernels are the process's; release() removes them


class KernelPath(Interceptor):
    """The Audit on this thread's stack while the kernels (registered by `Kernels.sync`) run."""
    name = "kernel"

    def __init__(self, kernels: Kernels = KERNELS):
        self.kernels = kernels
        self.stack = None

    def enter(self, audit) -> None:
        self.stack = active_stack()
        self.stack.append(audit)
        with self.kernels.lock:
            self.kernels.active += 1

    def exit(self, audit) -> None:
        st, self.stack = self.stack, None
        if st is None:
            return
        if st and st[-1] is audit:
            st.pop()
        elif audit in st:
            st.remove(audit)
        with self.kernels.lock:
            self.kernels.active -= 1
