"""Models for tests/ranks/test_internal_errors.py: the example model, with one of tpprobe's own steps
broken on rank 1 only, the way a bug in tpprobe breaks it (a name tpprobe's code calls is
unusable, so the TypeError is raised in tpprobe's own frame): the run must end with the
internal-error line and exit code, and the live rank's report must name the rank and the step."""
from __future__ import annotations

import tpprobe.capture.audit.recorder as recorder
import tpprobe.probe.pipeline as probe
from examples.my_model import build


def crash_in_write(ctx):
    """rank 1: building the rank record (after the forward) fails."""
    if ctx.rank == 1:
        probe.rank_record = None
    return build(ctx)


def crash_in_forward(ctx):
    """rank 1: the audit's record of the first all-reduce (a hook of ours, inside the forward) fails."""
    if ctx.rank == 1:
        recorder.dtype_name = None
    return build(ctx)


def crash_in_report(ctx):
    """rank 0: the checks (after every rank's capture is gathered) fail."""
    if ctx.rank == 0:
        probe.run_checks = None
    return build(ctx)


def model_raises(ctx):
    """rank 1: the model's own forward raises in layer 1 (not tpprobe's code): a rank-error on rank 1,
    and rank 0's collective that then fails is its consequence, not a failure of its own."""
    target = build(ctx)
    if ctx.rank == 1:
        layer = target.model.layers[1]
        inner = layer.forward

        def forward(*args, **kwargs):
            raise ValueError("the model's own bug in layer 1")
        layer.forward = forward
        del inner
    return target
