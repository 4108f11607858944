"""One probe on one rank: dist -> build model -> hooks -> forward -> write -> exchange -> check -> report.

`run(opts)` is what every rank executes (under torchrun, or under `tpprobe probe`'s own elastic
launch). It returns the exit code every rank agrees on: 0 healthy, 1 findings, 2 bad usage.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import faults as faults_mod
from .capture.files import check_out_dir, estimate_capture_bytes, remove_if_empty, write_manifest, write_rank
from .capture.hooks import Tap
from .capture.points import IN_NORM, id_point, parse
from .capture.progress import Progress
from .capture.record import rank_record
from .checks.evidence import FingerprintEvidence, add_fingerprints
from .checks.findings import exit_code
from .checks.run import run_checks
from .errors import UsageError
from .exchange.dist import (Channel, Watchdog, agree_out_dir, await_final, init, local_world, open_store, run_prefix,
                            shutdown)
from .exchange.fingerprint import PROBE_K, PROBE_SEED, fingerprint
from .exchange.gather import bytes_post, exchange_fingerprint, full_gather_bytes, gather_records
from .exchange.liveness import all_missing_explained, missing_info
from .model import BuiltinConfig, reference_streams
from .build import build_target, validate
from .options import ProbeOptions
from .target import ProbeTarget, RankContext


# ---- the pipeline --------------------------------------------------------------------------------
def run(opts: ProbeOptions) -> int:
    t_start = time.time()
    grace = min(5.0, max(1.0, opts.timeout * 0.2))
    ctx = init(None if opts.backend in ("auto", "sglang") else opts.backend, max(1.0, opts.timeout - grace), opts.seed)
    progress = Progress()
    from .exchange.live import attach as live_display
    live = live_display(progress, ctx.rank, quiet=opts.quiet or opts.json_out)
    ch = Channel(open_store(opts.timeout, run_prefix()), ctx.rank, ctx.world_size)
    watchdog = Watchdog(Channel(open_store(opts.timeout, run_prefix()), ctx.rank, ctx.world_size), progress,
                        stall=min(5.0, max(1.0, opts.timeout / 4)))
    watchdog.start()
    signal.signal(signal.SIGTERM, _on_sigterm)   # the launcher stops us when a peer died: finish the report
    code = 1
    try:
        code = _run(opts, ctx, ch, progress, grace, t_start)
    finally:
        live.stop()
        progress.set("done")
        watchdog.stop()
        watchdog.join(timeout=2)
        if ctx.rank == 0:
            ch.post("final", {"code": code}, rank=0)
    shutdown(ctx)
    return code


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

    @property
    def keep_all(self) -> bool:
        return self.opts.exchange == "full"


def _run(opts, ctx, ch, progress, grace, t_start) -> int:
    me = _Rank(opts, ctx, ch, progress, grace, t_start)
    code = _prepare(me)
    if code:
        return code
    tap, result, status, error = _forward(me)
    tensors, meta = _rank_record(me, tap, result, status, error)
    if ch.get("final", 0) is not None:   # stalled past the verdict: the manifest is already written
        return await_final(ch, 0)
    files = write_rank(me.out, ctx.rank, tensors, meta)
    posts = _post_and_collect(me, tensors, meta, files)
    records, evidence = _exchange(me, tensors, meta, posts)
    if ctx.rank != 0:
        return await_final(ch, opts.timeout + grace)
    return _check_and_report(me, records, evidence, posts, tensors)


def _prepare(me: _Rank) -> int:
    """Validate, agree on the folder, build the model, break it if asked. A usage error on any rank
    ends every rank with exit 2 (rank 0 says why)."""
    opts, ctx, ch = me.opts, me.ctx, me.ch
    try:
        validate(opts, ctx.world_size)
        out, me.created_out = agree_out_dir(opts, ctx, ch)
        me.out = Path(out)
        flt = faults_mod.parse(opts.inject, ctx.world_size, opts.num_layers, opts.layers)
        me.layer_ids = faults_mod.adjust_layer_ids(flt, list(opts.layers), opts.num_layers)
        me.progress.set("build")
        t0 = time.time()
        groups = faults_mod.prepare_groups(flt, ctx)
        me.target = build_target(ctx, opts, me.layer_ids)
        me.timings["build_s"] = time.time() - t0
        faults_mod.apply(flt, me.target, ctx, groups)
        if ctx.local_rank == 0:   # every rank of this node writes here: check the space once
            check_out_dir(me.out, estimate_capture_bytes(me.target, me.layer_ids, me.keep_all) * local_world())
        ch.post("ready", {"ok": True})
    except UsageError as e:
        if opts.debug:    # the message says "run with --debug": show where it came from (the cause too)
            import traceback
            traceback.print_exc()
        ch.post("ready", {"ok": False, "error": str(e), "code": 2})
    except Exception as e:     # a bug or a broken install on this rank: its traceback, then stop all
        import traceback
        traceback.print_exc()
        ch.post("ready", {"ok": False, "error": f"rank {ctx.rank} failed to build the model: "
                                                f"{type(e).__name__}: {e}", "code": 1})
    peers = ch.collect("ready", time.time() + opts.timeout,
                       stop_early=lambda found: any(not v.get("ok") for v in found.values()))
    bad = [v for r, v in sorted(peers.items()) if not v.get("ok")]
    if not bad and len(peers) < ctx.world_size:
        late = [r for r in range(ctx.world_size) if r not in peers]
        bad = [{"error": f"ranks {late} did not build the model within --timeout {opts.timeout:g}s", "code": 1}]
    if bad:
        if ctx.rank == 0:
            from .report.terminal import error_line
            error_line(bad[0]["error"])
            if me.out is not None and me.created_out:
                remove_if_empty(me.out)
        return max(v.get("code", 2) for v in bad)
    return 0


def _forward(me: _Rank):
    """One forward under the hooks. A peer that dies or a collective that times out ends the
    forward with status "error"; what was captured up to there is still reported."""
    keep_ids = {id_point(i) for i in me.layer_ids}
    keep = (lambda n: True) if me.keep_all else \
        (lambda n: n in keep_ids or parse(n).layer == -1 or parse(n).kind == IN_NORM)
    summarize = None if me.keep_all else (lambda t: fingerprint(t, seed=PROBE_SEED, k=PROBE_K))
    status, error, result = "ok", None, None
    t0 = time.time()
    me.progress.set("forward")
    target = me.target
    with torch.no_grad(), Tap(target.model, embed=me.opts.embed or target.embed, layers=me.opts.layer_list or target.layer_list,
                              input_ids=target.input_ids,
                              keep=keep, keep_allreduce_tensors=me.keep_all, progress=me.progress,
                              summarize=summarize, extensions=target.tap_extensions) as tap:
        tap.stream_from_layer_output = target.stream_from_layer_output
        try:
            result = target.forward()
        except Exception as e:
            status, error = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    me.timings["forward_s"] = time.time() - t0
    return tap, result, status, error


def _rank_record(me: _Rank, tap: Tap, result, status: str, error) -> tuple[dict, dict]:
    """This rank's tensors and metadata (and, with --exchange fingerprint, its fingerprints)."""
    me.progress.set("write")
    target, ctx = me.target, me.ctx
    packed = target.packed_aux(result) if status == "ok" and target.packed_aux is not None else None
    tensors, meta = rank_record(tap, rank=ctx.rank, world=ctx.world_size, input_ids=target.input_ids,
                                model=target.model, packed=packed, status=status, error=error,
                                timings=me.timings, device=ctx.device, extra={"hidden": target.hidden_size})
    if not me.keep_all:   # --exchange fingerprint: a few KB per capture travel, not the tensors
        add_fingerprints(meta, tap, packed, target.hidden_size, me.opts.torch_dtype)
    return tensors, meta


def _post_and_collect(me: _Rank, tensors: dict, meta: dict, files: list) -> dict:
    """Metadata through the store first, so ranks that died, hung or disagree never hang this one."""
    me.progress.set("exchange")
    ch, world = me.ch, me.ctx.world_size
    ch.post("meta", {"files": files, "status": meta["status"], "error": meta["error"],
                     "n_allreduce": len(meta["allreduces"]), "meta": meta,
                     "index": {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in tensors.items()}})
    deadline = time.time() + (me.grace if meta["status"] == "error" else me.opts.timeout)
    return ch.collect("meta", deadline, stop_early=lambda found: all_missing_explained(ch, found, world))


def _exchange(me: _Rank, tensors: dict, meta: dict, posts: dict):
    """The tensors (or what the checks need of them) to rank 0; bytes moved are posted for the report."""
    ctx, world = me.ctx, me.ctx.world_size
    all_ok = len(posts) == world and all(p["status"] == "ok" for p in posts.values())
    t1 = time.time()
    evidence, moved = None, {"sent": 0, "received": 0}
    if all_ok and not me.keep_all and world > 1:
        records, detail, moved = exchange_fingerprint(ctx, me.ch, tensors, meta, posts, me.opts.torch_dtype)
        if ctx.rank == 0:
            evidence = FingerprintEvidence(records, me.opts.torch_dtype, detail)
    else:
        records = gather_records(ctx, me.out, tensors, meta, posts, all_ok)
        if all_ok and world > 1:
            moved = full_gather_bytes(ctx.rank, world, posts)
    me.timings["exchange_s"] = time.time() - t1
    me.ch.post("bytes", bytes_post(ctx.rank, posts, moved))
    return records, evidence


def _settings(me: _Rank) -> dict:
    opts, target, ctx = me.opts, me.target, me.ctx
    shown_ids = target.model_layer_ids if opts.model and target.model_layer_ids is not None else me.layer_ids
    settings = {"world_size": ctx.world_size, "backend": ctx.backend, "dtype": opts.dtype, "layer_ids": shown_ids,
                "requested_layer_ids": list(opts.layers), "num_layers": target.num_layers,
                "hidden": target.hidden_size, "tokens": int(target.input_ids.numel()), "arch": target.arch,
                "model": opts.model or ("sglang:" + opts.arch if opts.backend == "sglang" else "builtin"),
                "inject": list(opts.inject), "exchange": opts.exchange, "timeout_s": opts.timeout,
                "model_packs_aux": target.packed_aux is not None,
                "seed": opts.seed, **{k: v for k, v in target.info.items() if isinstance(v, (int, float, str))}}
    if opts.backend == "sglang" or str(target.info.get("backend", "")).startswith("sglang"):
        # SGLang's capture-id rules per arch (DeepSeek: +1 only when the first id is 1)
        from .tools.layers import ARCHES, expected_slots, plan
        if target.arch in ARCHES:
            settings["expected_points"], settings["expected_ids"] = expected_slots(
                plan(target.arch, target.model_layer_ids, target.num_layers))
    return settings


def _check_and_report(me: _Rank, records: dict, evidence, posts: dict, tensors: dict) -> int:
    """Rank 0: the checks, report.json, the manifest, and the report on the terminal."""
    me.progress.set("report")
    ch, world = me.ch, me.ctx.world_size
    liveness = {"missing": {r: missing_info(ch, r, posts) for r in range(world) if r not in posts}}
    settings = _settings(me)
    references = reference_streams(BuiltinConfig.from_options(me.opts)) if me.target.arch == "builtin" else None
    t2 = time.time()
    result = run_checks(records, settings, liveness, references, evidence=evidence)
    from .report.model import build_report
    from .report.emit import emit
    report = build_report(settings, result, timings={**me.timings, "check_s": time.time() - t2,
                                                     "total_s": time.time() - me.t_start}, out=str(me.out))
    report["exchange"] = {"mode": me.opts.exchange, "bytes_per_rank": ch.collect("bytes", time.time() + me.grace),
                          "captured_bytes_per_rank": sum(t.numel() * t.element_size() for t in tensors.values())}
    # what only the live run knew (which rank died or hung, how long each phase took) stays with the files
    write_manifest(me.out, {"world_size": world, "ranks": sorted(posts), "settings": settings,
                                    "tool": report["tool"], "liveness": {str(r): v for r, v in liveness["missing"].items()},
                                    "timings": report["timings"]}, [f for p in posts.values() for f in p["files"]])
    emit(report, me.out, me.opts)
    return exit_code(report["findings"])


def _on_sigterm(signum, frame):
    # The elastic agent sends SIGTERM to every worker once one worker failed. We are already on our
    # way to report that failure (the dead peer breaks our collectives); keep going. SIGKILL follows
    # after the agent's grace period if we do not finish.
    pass
