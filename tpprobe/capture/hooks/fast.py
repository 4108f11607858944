"""The fast hook path: hooks written straight into torch.nn.Module's private hook dicts, opt-in and version-pinned.

Torch's own registration makes a RemovableHandle (with weak references) per hook, and the Tap
installs its hooks for every forward; writing the dicts as torch writes them is several times
cheaper (docs/benchmarks.md, bench/tap_enter.py).  A module with no hook at all keeps torch's fast
call path when its forward is wrapped instead (`Wrap`).  Both depend on torch's private layout, so
they are taken only on the torch releases ``config.knobs.FAST_PATHS["hooks"]`` names and while
TPPROBE_FAST_HOOKS allows (tests/ranks/test_fast_paths.py); the public path otherwise (install.py)."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils.hooks import RemovableHandle

from ...config.knobs import fast_path_refused

_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")
_LAYOUT = all(hasattr(torch.nn.Linear(1, 1), a) for a in _DICTS)


def refused(version: str = "") -> str:
    """Why the Tap registers its hooks through torch's public API ("" when it takes the fast path);
    ``version``: torch's, the installed one unless given."""
    why = fast_path_refused("hooks", version or torch.__version__)
    if why:
        return why
    return "" if _LAYOUT else "torch.nn.Module has no hook dicts of the expected names"


def usable(module) -> bool:
    """The module's hook dicts are as the fast path writes them."""
    return isinstance(getattr(module, "_forward_pre_hooks", None), OrderedDict)


class Pair:
    """A pre-hook and/or a forward hook written straight into one module's hook dicts, as torch's
    ``register_forward_pre_hook(prepend=True)`` / ``register_forward_hook`` write them, with ids
    from the same counter; ``remove()`` takes them out."""
    __slots__ = ("module", "pre_id", "post_id")

    def __init__(self, module, pre, post, with_kwargs: bool):
        i = RemovableHandle.next_id
        RemovableHandle.next_id = i + 2
        self.module, self.pre_id, self.post_id = module, (i if pre is not None else None), \
            (i + 1 if post is not None else None)
        if pre is not None:
            d = module._forward_pre_hooks
            d[i] = pre
            d.move_to_end(i, last=False)        # first: know where we are before any other pre-hook
            if with_kwargs:
                module._forward_pre_hooks_with_kwargs[i] = True
        if post is not None:
            module._forward_hooks[i + 1] = post
            if with_kwargs:
                module._forward_hooks_with_kwargs[i + 1] = True

    def remove(self) -> None:
        m = self.module
        if m is None:
            return
        self.module = None
        if self.pre_id is not None:
            m._forward_pre_hooks.pop(self.pre_id, None)
            m._forward_pre_hooks_with_kwargs.pop(self.pre_id, None)
        if self.post_id is not None:
            m._forward_hooks.pop(self.post_id, None)
            m._forward_hooks_with_kwargs.pop(self.post_id, None)


_NO_FORWARD = object()


class Wrap:
    """pre and post around the module's own forward, as an instance attribute ``forward``: for a
    module with no hooks at all, so that its call keeps torch's fast path (a module with any hook
    takes ``_call_impl``'s slow path). Equivalent to a first pre-hook and a last forward hook only
    while the module has no other hooks, which is why it is used only then (``hookless``).
    ``remove()`` puts back what was there."""
    __slots__ = ("module", "prev")

    def __init__(self, module, pre, post):
        d = module.__dict__
        self.module, self.prev = module, d.get("forward", _NO_FORWARD)
        inner = module.forward
        if pre is None:
            def forward(*args, **kwargs):
                out = inner(*args, **kwargs)
                post(module, args, out)
                return out
        else:
            def forward(*args, **kwargs):
                pre(module, args)
                out = inner(*args, **kwargs)
                post(module, args, out)
                return out
        forward.__wrapped__ = inner          # inspect.signature(module.forward) still reads the model's
        d["forward"] = forward

    def remove(self) -> None:
        m = self.module
        if m is None:
            return
        self.module = None
        if self.prev is _NO_FORWARD:
            m.__dict__.pop("forward", None)
        else:
            m.__dict__["forward"] = self.prev


def hookless(module) -> bool:
    """No hook of any kind on the module nor global ones: a wrapper is then the same as hooks."""
    mm = torch.nn.modules.module
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or mm._global_forward_hooks or mm._global_forward_pre_hooks
                or mm._global_backward_hooks or mm._global_backward_pre_hooks)
