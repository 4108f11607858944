"""How the audit watches the dispatcher: one `Interceptor` interface (name, enter, exit) for each path.

Three paths exist (kernel.py, doors.py, mode.py); an `Audit` picks them when it starts and names
them (``Audit.path``, ``Audit.paths``).  The kernel and the doors hand each collective to the Audit
on top of the running thread's stack (``active``), so other threads' collectives pass untouched."""
from __future__ import annotations

import threading

import torch

THREAD = threading.local()        # .stack: the Audits active on this thread (kernel and doors); each pops itself
_PYKEY = torch._C.DispatchKey.Python


class Interceptor:
    """One way of seeing collectives while an Audit is active."""
    name = ""

    def enter(self, audit) -> None:
        raise NotImplementedError

    def exit(self, audit) -> None:
        raise NotImplementedError


def active_stack() -> list:
    """The Audits active on this thread (kernel path), innermost last."""
    st = getattr(THREAD, "stack", None)
    if st is None:
        st = THREAD.stack = []
    return st


def active():
    """The running thread's innermost Audit on the kernel path, else None."""
    st = getattr(THREAD, "stack", None)
    return st[-1] if st else None


def wrapped(args) -> bool:
    """Whether the op's first tensor is a Python-dispatched one (a FakeTensor while torch.compile
    traces, a FunctionalTensor, a subclass): no collective runs here; the subclass's own handling
    issues the real one on plain tensors, and that is the one recorded."""
    for a in args:
        t = a if isinstance(a, torch.Tensor) else \
            a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else None
        if t is not None:
            return type(t) is not torch.Tensor and torch._C._dispatch_keys(t).has(_PYKEY)
    return False
