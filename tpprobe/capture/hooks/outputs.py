"""What a module's output holds: its first tensor, a decoder layer's residual stream, a DTensor's local part."""
from __future__ import annotations

from typing import Optional

import torch

from .. import discover
from ..params import dtensor_placements


def find_modules(model: torch.nn.Module, embed: Optional[str] = None, layers: Optional[str] = None):
    """(embedding (name, module) or None when it is found during the forward, [(index, name, module)]
    of decoder layers in order). See capture/discover.py."""
    _, _, found = discover.layer_list(model, layers)
    return (discover.embedding(model, embed) if embed else None), found


def local_tensor(t):
    """A DTensor's local tensor (no collective), any other tensor as it is."""
    return t.to_local() if dtensor_placements(t) is not None else t


def first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            if isinstance(y, torch.Tensor):
                return y
    return None


def is_owed(output) -> bool:
    """SGLang 0.5.23's OwedOutput (a decoder layer's partial sum the next boundary reduces)."""
    return type(output).__name__ in ("OwedOutput", "UnreducedOutput")


def residual_stream(output) -> Optional[torch.Tensor]:
    """The stream leaving a decoder layer: hidden_states + residual (SGLang's convention)."""
    if is_owed(output):
        return None
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        h = output[0]
        r = output[1] if len(output) > 1 and isinstance(output[1], torch.Tensor) else None
        return h.clone() if r is None else h + r
    return None
