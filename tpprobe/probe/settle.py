"""After the forward on a GPU: did the device finish, and what a dead or hung peer leaves behind.

NCCL never blocks the host in a collective, so the host returns from the forward while the GPU may
still wait in one a dead or hung peer never joins. `settle` waits for the stream with the deadline
(polling an event, never blocking); if it does not drain it reads the flight recorder, keeps only
what was computed before the collective that never completed (as a blocking backend would have),
copies that to the host on a stream of its own, hashes the replicated parameters there, and aborts
the communicator (its kernels return, nothing stays blocked). `resolve_summaries` then reads the
forward's deferred fingerprints in one copy (or drops them when the stream stayed blocked).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..capture.params import replicated_param_hashes
from ..capture.record import resolve_summaries
from ..exchange import dist as dist_mod
from ..fingerprint.reference import Deferred


@dataclass
class Settled:
    ok: bool = True                   # False: the model's stream is blocked (never sync it again)
    flight: Optional[dict] = None     # this rank's NCCL flight recorder, read when a collective hung
    params: Optional[dict] = None     # replicated-parameter hashes taken on a side stream
    side: object = None


def settle(tap, progress, target, summarize, timeout: float, grace: float, status: str, error):
    """(status, error, Settled) once the device drained or the deadline passed (CUDA only)."""
    progress.set("device")
    # the Tap already waited out the deadline at a collective (DeviceStalled): look once more only
    wait = 0.2 if tap.device_stalled else max(1.0, timeout - grace)
    if dist_mod.wait_device(time.time() + wait):
        return status, error, Settled()
    done = progress.device_done()
    audit = tap.allreduces
    stuck = audit[done + 1].meta() if done + 1 < len(audit) else {"seq": done + 1}
    got = Settled(ok=False, flight=dist_mod.flight_recorder())
    tap.truncate_to_device(done)
    # what was computed before the stuck collective is complete: copy it to the host on a stream
    # of its own (the model's stream is held behind the collective; this one waits on nothing)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for n in list(tap.captures):
            tap.captures[n] = tap.captures[n].to("cpu")
        for rec in tap.allreduces:
            rec.inp = rec.inp.to("cpu") if rec.inp is not None else None
            rec.out = rec.out.to("cpu") if rec.out is not None else None
        target.input_ids = target.input_ids.to("cpu")
        got.params = replicated_param_hashes(target.model)
        if isinstance(summarize, Deferred):
            keep = {id(v) for v in list(tap.summaries.values()) +
                    [x for r in tap.allreduces for x in (r.inp_summary, r.out_summary)]}
            summarize.resolve(only=keep)
    got.side = side
    aborted = dist_mod.abort_nccl(timeout=min(2.0, grace))
    msg = (f"all-reduce #{stuck['seq']} ({stuck.get('module', '?')}) did not complete on the GPU within "
           f"--timeout {timeout:g}s: a peer died, hung or issued other collectives; the NCCL "
           f"communicator was {aborted}")
    return "error", msg if tap.device_stalled or not error else error, got


def after_forward(tap, progress, target, summarize, timeout: float, grace: float, status: str, error, cuda: bool):
    """(status, error, Settled): `settle` on a GPU, then the deferred fingerprints read."""
    got = Settled()
    if cuda:
        status, error, got = settle(tap, progress, target, summarize, timeout, grace, status, error)
    resolve_summaries(tap, summarize, got.ok)
    return status, error, got


def stacks_after_env() -> None:
    """Diagnosis: TPPROBE_STACKS_AFTER=S dumps every thread's stack if the rank still runs after S s."""
    from ..config.knobs import knob, knob_float
    if knob("TPPROBE_STACKS_AFTER"):
        import faulthandler
        faulthandler.dump_traceback_later(knob_float("TPPROBE_STACKS_AFTER"), exit=False)


def leave_now(code: int) -> None:
    """The model's stream is held by a collective a dead peer never joins: NCCL's teardown would
    wait on it; the report is written, leave now."""
    import os
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
