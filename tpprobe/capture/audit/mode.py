"""The mode path: a `TorchDispatchMode` that sees every op and passes all but the audited ones straight through.

The fallback.  Taken when the Audit starts under `torch.inference_mode()` (inference tensors carry
no ADInplaceOrView key), when the caller says its tensors may be inference tensors (`use_mode=True`:
the Tap sets it when a parameter or buffer of the model is one), and when an audited op has its own
ADInplaceOrView kernel (a mutating `torch.library.custom_op`).  The mode keeps PyTorch's dynamo
guard around `__torch_dispatch__`: without it dynamo would try to compile the mode's frame when a
compiled region runs under the mode."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from .interceptor import Interceptor
from .records import PASS


class _Mode(TorchDispatchMode):
    def __init__(self, audit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in PASS:
            return func(*args, **kwargs)
        return self.audit.dispatch(func, args, kwargs)


class ModePath(Interceptor):
    name = "mode"

    def __init__(self, why: str):
        self.why = why
        self._mode = None

    def enter(self, audit) -> None:
        self._mode = _Mode(audit)
        self._mode.__enter__()

    def exit(self, audit, *exc) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*(exc or (None, None, None)))
