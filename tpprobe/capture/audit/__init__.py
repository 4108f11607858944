"""The collective audit: every reduce a rank issues during the forward, recorded once, where it runs.

Models reach a collective through many doors: `torch.distributed.all_reduce` (or the same function
imported under another name), the process group object, the functional collectives
(`_c10d_functional.all_reduce` + `wait_tensor`), sequence-parallel `reduce_scatter_tensor` +
`all_gather_into_tensor`, SGLang's and vLLM's `GroupCoordinator`.  Every door that ends in c10d goes
through the dispatcher as one of a few ops, so `Audit` watches the dispatcher, not Python attributes
(patching `torch.distributed.all_reduce` sees none of the aliased, functional or process-group calls).

What it cannot read, it still counts and names: any op whose name says it is a collective becomes a
record with `checked=False` and its op name as `path`; the coverage check reports each such path.

The paths, each an `Interceptor` (interceptor.py) chosen when an Audit starts and named by
``Audit.path`` / ``Audit.paths``; all record the same ops (`audited`) into the same records:
  kernel.py    a Python kernel at ADInplaceOrView on exactly the audited ops (the usual path);
  doors.py     ProcessGroup's methods wrapped while the kernels are registered (no dispatcher hop);
  mode.py      a TorchDispatchMode (inference mode, inference tensors, an op with its own kernel);
  wrappers.py  `Audit.collective`, for a layer above c10d that records its own collective.
records.py holds `CollectiveRecord` and what a complete collective returns (`expected_output`).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .doors import DOORS, Doors, DoorsPath
from .interceptor import Interceptor
from .kernel import KERNELS, KernelPath, Kernels
from .mode import ModePath
from .recorder import Audit, door_below, release, set_doors, sync
from .records import KINDS, REDUCES, CollectiveRecord, a2a_chunks, audited, dtype_name, expected_output, op_name

__all__ = ["DOORS", "KERNELS", "KINDS", "REDUCES", "Audit", "CollectiveRecord", "Doors", "DoorsPath", "Interceptor",
           "KernelPath", "Kernels", "ModePath", "a2a_chunks", "audited", "door_below", "dtype_name", "expected_output",
           "holds_inference_tensors", "op_name", "prepare", "release", "set_doors", "sync"]


def holds_inference_tensors(model: torch.nn.Module) -> bool:
    """Whether a parameter or buffer of the model is an inference tensor (made under inference
    mode): a collective on it would pass the kernels unseen, so the mode must watch."""
    return any(t.is_inference() for t in model.parameters()) or any(t.is_inference() for t in model.buffers())


def prepare(model: Optional[torch.nn.Module] = None) -> None:
    """Called before the ranks agree to start the forward, so no rank's forward (and no peer's
    collective timeout) waits on another rank's one-off work: registers the audit's kernels, and,
    when the mode path will watch (inference mode, a model holding inference tensors, or no model
    given), imports what the dispatch mode's first op imports (torch._dynamo, seconds on a loaded box)."""
    if sync() and model is not None and not torch.is_inference_mode_enabled() \
            and not holds_inference_tensors(model):
        return
    importlib.import_module("torch._dynamo")
