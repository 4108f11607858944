"""The wrapper API: a layer above c10d (SGLang's or vLLM's GroupCoordinator, a custom all-reduce) records its own.

    with tap.auditor.collective("all_reduce", "sglang.GroupCoordinator.all_reduce", inp=x,
                                group_size=gc.world_size) as rec:
        out = original(gc, x)
        rec.output(out)           # the reduced tensor (in-place reduces: the input itself)

Inside that block the dispatcher-level paths record nothing of their own (a re-entrancy guard): the
c10d op they see is appended to `rec.via`, so one reduce is counted once, with its whole path.
Collectives that never reach the dispatcher (pynccl through ctypes, symmetric memory) are
invisible to the other paths: a wrapper must record them here, else the reduce counts show the gap."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


@contextmanager
def collective(audit, kind: str, path: str, inp: Optional[torch.Tensor], group_size: int, op: str = "SUM"):
    """Record one collective on `audit`; the c10d ops it issues inside are folded into it (`via`),
    not counted again.  Call `rec.output(tensor)` with the result; without it the input (an
    in-place reduce) is read."""
    if audit.active_record is not None:          # nested wrapper: the outer record already counts it
        audit.active_record.via.append(path)
        yield audit.active_record
        return
    rec = audit.begin(kind, path, inp, group_size, op)
    rec._out = None
    audit.active_record = rec
    try:
        yield rec
    finally:
        audit.active_record = None
    audit.end(rec, rec._out if rec._out is not None else inp)
