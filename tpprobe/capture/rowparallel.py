"""Which modules are row-parallel: their output is each rank's partial sum until a reduce.

Recognised from structure, for any model, never from the class name alone:

  placements  the weight is a DTensor sharded on its input dimension (`Shard(1)` of an
              `nn.Linear`'s [out, in] weight: DTensor `RowwiseParallel`)
  attributes  the module says so the way SGLang's, vLLM's and Megatron's row-parallel layers do:
              `input_is_parallel=True`, or a `reduce_results` flag on a module with a 2-D weight
              (their RowParallelLinear; an MoE block's experts are left to the reduce counts: their
              output is often summed with a shared expert's before the one reduce)
  shape       (opt-in: `by_shape=True`) a 2-D weight [hidden, hidden / tp]: the attention output
              projection's shard. Off by default: a block that reduces the SUM of two row-parallel
              outputs itself (GPT-J's parallel attention + MLP) has such a weight whose own output no
              reduce consumes, so by shape alone a healthy GPT-J would look unreduced.

The class-name glob `*RowParallel*` stays a last fallback for models older code recognised so.
`is_row_parallel` is the whole rule in one call; the Tap's plan asks it through
`discover.is_row_parallel`.
"""
from __future__ import annotations

import fnmatch
from typing import Optional

import torch

NAME_PATTERNS = ("*RowParallel*",)


def _weight(module: torch.nn.Module):
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def by_placements(module: torch.nn.Module) -> Optional[bool]:
    """True/False when the weight is a DTensor (sharded on its input dim or not), else None."""
    w = _weight(module)
    placements = getattr(w, "placements", None)
    if w is None or placements is None:
        return None
    try:
        from torch.distributed.tensor import Shard
    except Exception:  # noqa: BLE001 - an old torch without the public DTensor API
        return None
    in_dim = w.dim() - 1
    return any(isinstance(p, Shard) and p.dim in (in_dim, -1) for p in placements)


def by_attributes(module: torch.nn.Module) -> Optional[bool]:
    """True when the module declares an input-parallel shard or owns a reduce flag; None otherwise."""
    if getattr(module, "input_is_parallel", None) is True:
        return True
    w = _weight(module)
    if isinstance(getattr(module, "reduce_results", None), bool) and w is not None and w.dim() == 2:
        return True
    return None


def by_shape(module: torch.nn.Module, hidden: Optional[int], world: int) -> Optional[bool]:
    w = _weight(module)
    if w is None or w.dim() != 2 or not hidden or world <= 1:
        return None
    return (w.shape[0] == hidden and w.shape[1] * world == hidden) or None


def is_row_parallel(module: torch.nn.Module, hidden: Optional[int] = None, world: int = 1,
                    shape: bool = False) -> bool:
    for verdict in (by_placements(module), by_attributes(module),
                    by_shape(module, hidden, world) if shape else None):
        if verdict is not None:
            return verdict
    return any(fnmatch.fnmatchcase(type(module).__name__, p) for p in NAME_PATTERNS)
