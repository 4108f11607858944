"""One probe on one rank: dist -> build model -> hooks -> forward -> write -> exchange -> check -> report.

`run(opts)` is what every rank executes (under torchrun, or under `tpprobe probe`'s own elastic
launch). It returns the exit code every rank agrees on: 0 healthy, 1 findings, 2 bad usage.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .prepare import build_with_faults, capture_size, out_of_memory, probe_settings, validate
from ..capture.audit import prepare as prepare_audit
from ..formats.capture_dir import check_out_dir, remove_if_empty, write_manifest, write_rank
from ..capture.hooks import Tap
from ..capture.progress import Progress
from ..capture.record import PROBE_SKETCH, rank_record
from ..checks.evidence import FingerprintEvidence
from ..checks.findings import exit_code
from ..core.errors import INTERNAL_EXIT, InternalError, TPProbeError, exception_text, say_internal
from ..checks.run import run_checks
from ..exchange.dist import (Channel, agree_out_dir, agree_ready, await_final, init, local_world, named_process_group,
                             post_ready, shutdown, start_channels)
from .settle import Settled, leave_now, stacks_after_env
from ..exchange.gather import bytes_post, exchange_records, exchange_summary, post_meta
from ..exchange.liveness import collect_meta, liveness_of
from .forward import forward_under_tap
from ..engines import fault_fired
from ..engines.registry import engine_of, recorded
from ..config.options import ProbeOptions
from .. import __version__
from ..report.emit import emit
from ..report.model import build_report
from .report import probe_report
from ..core.target import ProbeTarget, RankContext


def run(opts: ProbeOptions, keep_group: bool = False) -> int:
    t_start = time.time()
    stacks_after_env()
    grace = min(5.0, max(1.0, opts.timeout * 0.2))
    ctx = init(named_process_group(opts.backend), max(1.0, opts.timeout - grace), opts.seed)
    progress = Progress()
    from ..report.live import attach as live_display
    live = live_display(progress, ctx.rank, quiet=opts.quiet or opts.json_out)
    ch, watchdog = start_channels(ctx, opts.timeout, progress, end_stuck=not keep_group)
    # The elastic agent sends SIGTERM to every worker once one worker failed. We are already on our way
    # to report that failure (the dead peer breaks our collectives): keep going; SIGKILL follows later.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    code, box = 1, {}
    try:
        code = _run(opts, ctx, ch, progress, grace, t_start, box)
    except TPProbeError as e:
        code = e.exit_code          # the other ranks end with it too (rank 0 posts it below)
        raise
    except Exception as e:      # tpprobe's own code failed here: one line, exit 3, the others report it
        code = _internal_error(e, ctx, ch, progress, opts.debug)
    finally:
        live.stop()
        progress.set("done")
        watchdog.stop()
        watchdog.join(timeout=2)
        if ctx.rank == 0:
            ch.post("final", {"code": code}, rank=0)
    if "me" in box and not box["me"].device.ok:
        leave_now(code)       # the model's stream is held by a dead peer's collective: no NCCL teardown
    if not keep_group:      # keep_group: a caller that probes again on the same group (tests/ranks/test_zoo.py)
        shutdown(ctx)
    return code


def _internal_error(e: Exception, ctx, ch, progress, debug: bool) -> int:
    """A bug in tpprobe on this rank: say it in one line (the traceback with --debug), post it so the
    live ranks' report names this rank and the step, and end with INTERNAL_EXIT."""
    step = e.step if isinstance(e, InternalError) else progress.phase
    cause = e.cause if isinstance(e, InternalError) else e
    say_internal(cause, ctx.rank, step, debug)
    try:
        ch.post("crash", {"step": step, "error": exception_text(cause)})
    except Exception:   # the store is gone too: the others see a dead rank
        pass
    return INTERNAL_EXIT


@dataclass
class _Rank:
    """What one rank carries through the pipeline."""
    opts: ProbeOptions
    ctx: RankContext
    ch: Channel
    progress: Progress
    grace: float
    t_start: float
    out: Optional[Path] = None
    created_out: bool = False
    target: Optional[ProbeTarget] = None
    layer_ids: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    device: Settled = field(default_factory=Settled)   # the GPU after the forward (probe/settle.py)

    @property
    def keep_all(self) -> bool:
        return self.opts.exchange == "full"


def _run(opts, ctx, ch, progress, grace, t_start, box: dict) -> int:
    me = box["me"] = _Rank(opts, ctx, ch, progress, grace, t_start)
    code = _prepare(me)
    if code:
        return code
    tap, result, status, error = _forward(me)
    tensors, meta = _rank_record(me, tap, result, status, error)
    if ch.get("final", 0) is not None:   # stalled past the verdict: the manifest is already written
        me.progress.set("verdict")
        return await_final(ch, 0)
    files = write_rank(me.out, ctx.rank, tensors, meta)
    me.progress.set("exchange")    # metadata through the store first: a dead or hung rank never hangs this one
    post_meta(ch, tensors, meta, files)
    posts = collect_meta(ch, ctx.world_size, time.time() + (grace if meta["status"] == "error" else opts.timeout))
    records, evidence = _exchange(me, tensors, meta, posts)
    if ctx.rank != 0:
        me.progress.set("verdict")      # waiting for rank 0's verdict: not stuck (the watchdog lets it end)
        return await_final(ch, opts.timeout + grace)
    return _check_and_report(me, records, evidence, posts, tensors)


def _prepare(me: _Rank) -> int:
    """Validate, agree on the folder, build the model, break it if asked. A usage error on any rank
    ends every rank with exit 2 (rank 0 says why)."""
    opts, ctx, ch = me.opts, me.ctx, me.ch
    post_ready(ch, ctx.rank, opts.debug, lambda: _build(me))
    bad = agree_ready(ch, ctx.world_size, opts.timeout)
    # init, build and the wait for the slowest peer to start (the launcher's skew, not the probe's):
    # the probe's own clock, forward to verdict, is total_s - start_s
    me.timings["start_s"] = time.time() - me.t_start
    if bad and ctx.rank == 0:
        from ..report.terminal import error_line
        if bad[0].get("traceback"):
            print(bad[0]["traceback"], end="", file=sys.stderr, flush=True)
        if bad[0].get("internal"):
            from ..core.errors import internal_message
            print(internal_message(bad[0]["error"], opts.debug), file=sys.stderr, flush=True)
        else:
            error_line(bad[0]["error"])
        if me.out is not None and me.created_out:
            remove_if_empty(me.out)
    return max(v.get("code", 2) for v in bad) if bad else 0


def _build(me: _Rank) -> None:
    opts, ctx = me.opts, me.ctx
    validate(opts, ctx.world_size)
    out, me.created_out = agree_out_dir(opts, ctx, me.ch)
    me.out = Path(out)
    me.progress.set("build")
    t0 = time.time()
    me.target, me.layer_ids = build_with_faults(ctx, opts)
    me.timings["build_s"] = time.time() - t0
    prepare_audit(me.target.model)
    est = capture_size(me.target, me.layer_ids, opts)
    if ctx.local_rank == 0:   # every rank of this node writes here: check the space once
        check_out_dir(me.out, est * local_world())


def _forward(me: _Rank):
    """One forward under the hooks (tpprobe/probe/forward.py); what was captured is reported even when it failed."""
    t0 = time.time()
    tap, result, status, error, me.device = forward_under_tap(me.target, me.opts, me.progress, me.layer_ids,
                                                              me.keep_all, me.grace, me.ctx.device.type == "cuda")
    me.timings["forward_s"] = time.time() - t0
    return tap, result, status, error


def _rank_record(me: _Rank, tap: Tap, result, status: str, error) -> tuple[dict, dict]:
    """This rank's tensors and metadata (and, with --exchange fingerprint, its fingerprints)."""
    me.progress.set("write")
    target, ctx = me.target, me.ctx
    packed = target.packed_aux(result) if status == "ok" and target.packed_aux is not None else None
    # --exchange fingerprint: a few KB per capture travel, not the tensors
    record = rank_record(tap, rank=ctx.rank, world=ctx.world_size, input_ids=target.input_ids, model=target.model,
                         hidden=target.hidden_size, packed=packed, status=status, error=error, timings=me.timings,
                         device=ctx.device, params=me.device.params,
                         fingerprints=None if me.keep_all else PROBE_SKETCH, slot_dtype=me.opts.torch_dtype,
                         extra={fault_fired.KEY: fault_fired.counts()} if me.opts.inject else None)
    return record.tensors, record.to_json()


def _exchange(me: _Rank, tensors: dict, meta: dict, posts: dict):
    """The tensors (or what the checks need of them) to rank 0; bytes moved are posted for the report."""
    ctx, world = me.ctx, me.ctx.world_size
    all_ok = len(posts) == world and all(p["status"] == "ok" for p in posts.values())
    t1 = time.time()
    fingerprints = all_ok and not me.keep_all and world > 1
    records, detail, moved = exchange_records(ctx, me.ch, me.out, tensors, meta, posts, all_ok, fingerprints,
                                              me.opts.torch_dtype)
    evidence = FingerprintEvidence(records, me.opts.torch_dtype, detail) if fingerprints and ctx.rank == 0 else None
    me.timings["exchange_s"] = time.time() - t1
    me.ch.post("bytes", bytes_post(ctx.rank, posts, moved))
    return records, evidence


def _references(me: _Rank, posts: dict) -> Optional[dict]:
    """The engine's unsharded streams (the whole model in this one process): a run too large for them is bad
    input, said as the build says it (prepare.out_of_memory); the rank files this run wrote go with it (no
    manifest names them yet), and so does the folder when it was made for this run."""
    try:
        return engine_of(me.opts).reference_streams(me.opts)
    except (MemoryError, RuntimeError) as e:
        err = out_of_memory(e, me.opts, me.ctx.rank, "in the unsharded reference forward, the whole model in "
                            "one process that the ranks are checked against", nproc_helps=False)
        if err is None:
            raise
        if me.out is not None:
            for f in (f for p in posts.values() for f in p.get("files", [])):
                (me.out / f["path"]).unlink(missing_ok=True)
            if me.created_out:
                remove_if_empty(me.out)
        raise err from None


def unfired(inject: list, posts: dict, world: int):
    """The line naming an --inject fault that fired on no rank (tpprobe/engines/fault_fired.py), else None."""
    return fault_fired.unfired_line(inject, world, {r: (p["status"], p["meta"].get(fault_fired.KEY))
                                                    for r, p in posts.items()})


def _check_and_report(me: _Rank, records: dict, evidence, posts: dict, tensors: dict) -> int:
    """Rank 0: the checks, report.json, the manifest, and the report on the terminal."""
    me.progress.set("report")
    ch, world = me.ch, me.ctx.world_size
    liveness = liveness_of(ch, world, posts, me.grace, me.ctx.backend, me.device.flight)
    settings = probe_settings(me.opts, me.ctx, me.target, me.layer_ids)
    references = _references(me, posts)
    files = [f for p in posts.values() for f in p["files"]]

    def manifest(timings: dict) -> None:
        # what only the live run knew (which rank died or hung, how long each phase took) stays with the files
        write_manifest(me.out, {"world_size": world, "ranks": sorted(posts), "settings": settings,
                                "tool": f"tpprobe {__version__}",
                                "liveness": {str(r): v for r, v in liveness["missing"].items()},
                                "timings": timings}, files)
    # first before the checks: a run whose checks fail still leaves a folder `tpprobe report` reads
    manifest(dict(me.timings))
    if (line := unfired(me.opts.inject, posts, world)) is not None:
        from ..report.terminal import error_line
        error_line(line)        # no verdict: the fault asked for never acted (`tpprobe report` says the same)
        return 2
    t2 = time.time()
    result = run_checks(records, settings, liveness, references, evidence=evidence,
                        offset_rule=recorded(settings).offset_rule)
    report = build_report(settings, result, timings={**me.timings, "check_s": time.time() - t2,
                                                     "total_s": time.time() - me.t_start}, out=str(me.out))
    if liveness.get("flight_recorder"):
        report["flight_recorder"] = liveness["flight_recorder"]
    report["exchange"] = exchange_summary(me.opts.exchange, ch, posts, tensors, time.time() + me.grace)
    manifest(report["timings"])
    emit(probe_report(report, me.out), me.out, me.opts)
    return exit_code(report["findings"])
