"""The probe's forward: one forward of the target under the hooks (capture/hooks Tap).

A peer that dies or a collective that times out ends the forward with status "error"; what was
captured up to there is still reported. On a GPU the host runs ahead of the device: the Tap bounds
how far (`device_lag`, raising DeviceStalled), and probe/settle.py settles the device after the
forward (flight recorder, abort, keep what a blocking backend would have). With --exchange
fingerprint every capture's kernels are queued during the forward and read after it in one copy.
"""
from __future__ import annotations

import torch

from ..capture.hooks import Tap
from ..capture.points import kept_beside_fingerprints
from ..core.errors import InternalError, raised_in_tpprobe
from .settle import after_forward
from ..fingerprint.reference import PROBE_K, PROBE_SEED, Deferred


def forward_under_tap(target, opts, progress, layer_ids: list, keep_all: bool, grace: float, cuda: bool):
    """(tap, result, status, error, Settled) of one forward of `target` under a Tap."""
    keep = (lambda n: True) if keep_all else kept_beside_fingerprints(layer_ids)
    summarize = None if keep_all else Deferred(PROBE_SEED, PROBE_K)
    status, error, result = "ok", None, None
    progress.set("forward")
    with torch.no_grad(), Tap(target.model, embed=opts.embed or target.embed, input_ids=target.input_ids,
                              layers=opts.layer_list or target.layer_list, keep=keep, progress=progress,
                              keep_allreduce_tensors=keep_all, summarize=summarize,
                              extensions=target.tap_extensions,
                              device_lag=(2, max(1.0, opts.timeout - grace))) as tap:
        tap.stream_from_layer_output = target.stream_from_layer_output
        try:
            result = target.forward()
        except Exception as e:
            if progress.collective is None and raised_in_tpprobe(e):
                raise InternalError("forward", e) from e   # a hook of ours failed, not the model
            status, error = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            tap.note_error(e)        # the module it raised in: the finding's place
    status, error, settled = after_forward(tap, progress, target, summarize, opts.timeout, grace, status, error, cuda)
    return tap, result, status, error, settled
