"""How the Tap hooks a module: torch's public registration by default, the fast path where chosen (fast.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from . import fast


@dataclass
class HookHandle:
    kind: str                 # "embed" | "layer" | "module"
    name: str                 # qualified module name
    index: Optional[int]      # layer index for decoder layers
    handles: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __repr__(self) -> str:
        idx = "" if self.index is None else f"[{self.index}]"
        return f"<{self.kind}{idx} {self.name}>"


def add_hooks(module: torch.nn.Module, pre, post, with_kwargs: bool = False, wrap: bool = False,
              fast_path: bool = False) -> list:
    """pre (first of the module's pre-hooks) and post (last of its forward hooks), either may be
    None: handles with ``remove()``.  Through torch's ``register_forward_pre_hook(prepend=True)`` /
    ``register_forward_hook``; with ``fast_path`` (the Tap's choice, fast.refused) written into the
    module's hook dicts instead, and with wrap=True (post given, no kwargs) around the module's
    forward when the module has no other hook."""
    if fast_path and fast.usable(module):
        if wrap and post is not None and not with_kwargs and fast.hookless(module):
            return [fast.Wrap(module, pre, post)]
        return [fast.Pair(module, pre, post, with_kwargs)]
    return ([module.register_forward_pre_hook(pre, prepend=True, with_kwargs=with_kwargs)] if pre else []) + \
        ([module.register_forward_hook(post, with_kwargs=with_kwargs)] if post else [])
