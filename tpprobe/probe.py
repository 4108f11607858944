"""One probe on one rank: dist -> build model -> hooks -> forward -> write -> exchange -> check -> report.

`run(opts)` is what every rank executes (under torchrun, or under `tpprobe probe`'s own elastic
launch). It returns the exit code every rank agrees on: 0 healthy, 1 findings, 2 bad usage.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import faults as faults_mod
from .capture import files as capture
from .capture.hooks import Tap
from .capture.params import replicated_param_hashes
from .capture.points import id_point
from .capture.progress import Progress
from .checks.findings import exit_code
from .checks.run import run_checks
from .errors import TPProbeError, UsageError
from .exchange import dist as dist_mod
from .exchange.dist import Channel, Watchdog, init, open_store, run_prefix
from .exchange.fingerprint import Deferred, fingerprint, resolved
from .model import BuiltinConfig
from .target import ProbeTarget, RankContext

FP_SEED, FP_K = 0x7470, 32     # every rank sketches with the same signs

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

_BUILTIN = BuiltinConfig()


@dataclass
class ProbeOptions:
    # the built-in model's shape: BuiltinConfig's defaults, declared once there
    layers: list[int] = field(default_factory=lambda: list(_BUILTIN.layer_ids))
    num_layers: int = _BUILTIN.num_layers
    hidden: int = _BUILTIN.hidden
    heads: int = _BUILTIN.heads
    ffn: int = _BUILTIN.ffn
    vocab: int = _BUILTIN.vocab
    tokens: int = _BUILTIN.tokens
    seed: int = _BUILTIN.seed
    dtype: str = str(_BUILTIN.dtype).removeprefix("torch.")
    backend: str = "auto"            # auto | gloo | nccl | sglang (SGLang's model on gloo/nccl)
    arch: str = "llama"              # with --backend sglang
    config: Optional[str] = None     # with --backend sglang: a real config.json, random weights
    model: Optional[str] = None      # package.module:factory
    inject: list[str] = field(default_factory=list)
    out: Optional[str] = None
    timeout: float = 60.0
    exchange: str = "full"           # full | fingerprint
    embed_pattern: str = "VocabParallelEmbedding"
    layer_pattern: str = "*DecoderLayer"
    quiet: bool = False
    json_out: bool = False
    html: Optional[str] = None
    markdown: Optional[str] = None
    nproc: int = 2
    debug: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise UsageError(f"unknown --dtype {self.dtype!r}: use float32, bfloat16 or float16")
        return DTYPES[self.dtype]


def validate(opts: ProbeOptions, world: int) -> None:
    """Everything that can be checked before any process starts; raises UsageError."""
    _ = opts.torch_dtype
    if world < 1:
        raise UsageError(f"--nproc must be >= 1 (got {world})")
    if opts.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds (got {opts.timeout})")
    if opts.exchange not in ("full", "fingerprint"):
        raise UsageError(f"unknown --exchange {opts.exchange!r}: use full or fingerprint")
    if opts.backend not in ("auto", "gloo", "nccl", "sglang"):
        raise UsageError(f"unknown --backend {opts.backend!r}: use auto, gloo, nccl or sglang")
    if opts.arch not in ("llama", "deepseek_v2"):   # the tiny SGLang models tpprobe builds
        raise UsageError(f"unknown --arch {opts.arch!r}: use llama or deepseek_v2 (with --backend sglang)")
    ids = opts.layers
    if len(set(ids)) != len(ids):
        raise UsageError(f"--layers has duplicate ids {ids}: each layer id once")
    if not ids:
        raise UsageError("--layers is empty: give ids like -1,1,3 (-1 = the embedding)")
    if opts.model is None:
        bad = [i for i in ids if i < -1 or i >= opts.num_layers]
        if bad:
            raise UsageError(f"--layers {bad} out of range for a model of {opts.num_layers} layers: "
                             f"ids run from -1 (embedding) to {opts.num_layers - 1}")
        if opts.backend != "sglang":
            builtin_config(opts).validate(world)
    if opts.model is not None and ":" not in opts.model:
        raise UsageError(f"--model {opts.model!r} must be package.module:factory")
    if opts.inject and (opts.model or opts.backend == "sglang"):
        raise UsageError("--inject works on the built-in model only (drop --model / --backend sglang)")
    faults_mod.parse(opts.inject, world, opts.num_layers, ids)


# ---- building the target -----------------------------------------------------------------------
def build_target(ctx: RankContext, opts: ProbeOptions, layer_ids: list[int]) -> ProbeTarget:
    if opts.model:
        return _user_target(ctx, opts.model)
    if opts.backend == "sglang":
        from .sglang.tiny import build_target as sglang_target
        return sglang_target(ctx, arch=opts.arch, num_layers=opts.num_layers, tokens=opts.tokens, seed=opts.seed,
                             dtype=opts.torch_dtype, layer_ids=layer_ids, config_path=opts.config)
    from .model import build_builtin
    return build_builtin(ctx, builtin_config(opts, layer_ids))


def _user_target(ctx: RankContext, spec: str) -> ProbeTarget:
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--model {spec}: cannot import {fn_name!r} from {mod_name!r} ({e}); "
                         f"check the module is on PYTHONPATH")
    try:
        target = fn(ctx)
    except TPProbeError:
        raise
    except Exception as e:
        raise UsageError(f"--model {spec}: the factory raised {type(e).__name__}: {e}; run with --debug for the traceback") from e
    if not isinstance(target, ProbeTarget):
        raise UsageError(f"--model {spec}: the factory returned {type(target).__name__}, expected "
                         f"tpprobe.ProbeTarget(model=..., forward=..., input_ids=..., ...)")
    return target


# ---- the pipeline --------------------------------------------------------------------------------
def run(opts: ProbeOptions) -> int:
    t_start = time.time()
    if os.environ.get("TPPROBE_STACKS_AFTER"):   # diagnosis: every thread's stack if still running then
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["TPPROBE_STACKS_AFTER"]), exit=False)
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
    me_box: dict = {}
    try:
        code = _run(opts, ctx, ch, progress, grace, t_start, me_box)
    finally:
        live.stop()
        progress.set("done")
        watchdog.stop()
        watchdog.join(timeout=2)
        if ctx.rank == 0:
            ch.post("final", {"code": code}, rank=0)
    if me_box.get("me") is not None and not me_box["me"].device_ok:
        # the model's stream is held by a collective a dead peer never joins: NCCL's teardown would
        # wait on it; the report is written, leave now
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _shutdown(ctx)
    return code


def _shutdown(ctx) -> None:
    try:
        if ctx.world_size > 1:
            # let every rank read the verdict before the store's host (rank 0's agent) may go
            dist.destroy_process_group()
    except Exception:
        pass


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
    target: Optional[ProbeTarget] = None
    layer_ids: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    flight: Optional[dict] = None     # this rank's NCCL flight recorder, read when a collective hung
    device_ok: bool = True            # False: the model's stream is blocked (never sync it again)
    params: Optional[dict] = None     # replicated-parameter hashes taken on a side stream
    summarize: object = None
    side: object = None

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
        return _await_final(ch, 0)
    files = capture.write_rank(me.out, ctx.rank, tensors, meta)
    posts = _post_and_collect(me, tensors, meta, files)
    records, evidence = _exchange(me, tensors, meta, posts)
    if ctx.rank != 0:
        return _await_final(ch, opts.timeout + grace)
    return _check_and_report(me, records, evidence, posts, tensors)


def _prepare(me: _Rank) -> int:
    """Validate, agree on the folder, build the model, break it if asked. A usage error on any rank
    ends every rank with exit 2 (rank 0 says why)."""
    opts, ctx, ch = me.opts, me.ctx, me.ch
    try:
        validate(opts, ctx.world_size)
        me.out = Path(_agree_out_dir(opts, ctx, ch))
        flt = faults_mod.parse(opts.inject, ctx.world_size, opts.num_layers, opts.layers)
        me.layer_ids = faults_mod.adjust_layer_ids(flt, list(opts.layers), opts.num_layers)
        me.progress.set("build")
        groups = faults_mod.prepare_groups(flt, ctx)
        me.target = build_target(ctx, opts, me.layer_ids)
        faults_mod.apply(flt, me.target, ctx, groups)
        if ctx.local_rank == 0:   # every rank of this node writes here: check the space once
            capture.check_out_dir(me.out, estimate_capture_bytes(me.target, me.layer_ids, me.keep_all) * _local_world())
        ch.post("ready", {"ok": True})
    except UsageError as e:
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
        return max(v.get("code", 2) for v in bad)
    return 0


def _forward(me: _Rank):
    """One forward under the hooks. A peer that dies or a collective that times out ends the
    forward with status "error"; what was captured up to there is still reported."""
    keep_ids = {id_point(i) for i in me.layer_ids}
    keep = (lambda n: True) if me.keep_all else \
        (lambda n: n in keep_ids or n.startswith("embed") or n.endswith("in_norm"))
    # --exchange fingerprint: kernels queued during the forward, read after it in one copy
    summarize = me.summarize = None if me.keep_all else Deferred(FP_SEED, FP_K)
    status, error, result = "ok", None, None
    t0 = time.time()
    me.progress.set("forward")
    target = me.target
    with torch.no_grad(), Tap(target.model, embed_pattern=me.opts.embed_pattern, layer_pattern=me.opts.layer_pattern,
                              keep=keep, keep_allreduce_tensors=me.keep_all, progress=me.progress,
                              summarize=summarize, extensions=target.tap_extensions,
                              device_lag=(2, max(1.0, me.opts.timeout - me.grace))) as tap:
        tap.stream_from_layer_output = target.stream_from_layer_output
        try:
            result = target.forward()
        except Exception as e:
            status, error = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if me.ctx.device.type == "cuda":
        status, error = _settle_device(me, tap, status, error)
    if summarize is not None:
        summarize.resolve() if me.device_ok else summarize.drop()   # (resolved on the side stream)
        tap.summaries = {n: resolved(v) for n, v in tap.summaries.items() if resolved(v) is not None}
        for rec in tap.allreduces:
            rec.inp_summary, rec.out_summary = resolved(rec.inp_summary), resolved(rec.out_summary)
    me.timings["forward_s"] = time.time() - t0
    return tap, result, status, error


def _settle_device(me: _Rank, tap: Tap, status: str, error):
    """NCCL: the host returns from the forward while the GPU may still wait in a collective a dead
    or hung peer never joins. Wait for the stream with the deadline (polling an event, never
    blocking); if it does not drain, read the flight recorder, abort the communicator (its kernels
    return, nothing stays blocked) and keep only what was computed before the collective that
    never completed, as a blocking backend would have."""
    me.progress.set("device")
    # the Tap already waited out the deadline at a collective (DeviceStalled): look once more only
    wait = 0.2 if tap.device_stalled else max(1.0, me.opts.timeout - me.grace)
    if dist_mod.wait_device(time.time() + wait):
        return status, error
    done = me.progress.device_done()
    audit = tap.allreduces
    stuck = audit[done + 1].meta() if done + 1 < len(audit) else {"seq": done + 1}
    me.flight = dist_mod.flight_recorder()
    tap.truncate_to_device(done)
    # what was computed before the stuck collective is complete: copy it to the host on a stream
    # of its own (the model's stream is held behind the collective; this one waits on nothing)
    me.device_ok = False
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for d in (tap.captures,):
            for n in list(d):
                d[n] = d[n].to("cpu")
        for rec in tap.allreduces:
            rec.inp = rec.inp.to("cpu") if rec.inp is not None else None
            rec.out = rec.out.to("cpu") if rec.out is not None else None
        me.target.input_ids = me.target.input_ids.to("cpu")
        me.params = replicated_param_hashes(me.target.model)
        if isinstance(me.summarize, Deferred):
            keep = {id(v) for v in list(tap.summaries.values()) +
                    [x for r in tap.allreduces for x in (r.inp_summary, r.out_summary)]}
            me.summarize.resolve(only=keep)
    me.side = side
    aborted = dist_mod.abort_nccl(timeout=min(2.0, me.grace))
    msg = (f"all-reduce #{stuck['seq']} ({stuck.get('module', '?')}) did not complete on the GPU within "
           f"--timeout {me.opts.timeout:g}s: a peer died, hung or issued other collectives; the NCCL "
           f"communicator was {aborted}")
    return "error", msg if tap.device_stalled or not error else error




def _rank_record(me: _Rank, tap: Tap, result, status: str, error) -> tuple[dict, dict]:
    """This rank's tensors and metadata (and, with --exchange fingerprint, its fingerprints)."""
    me.progress.set("write")
    target, ctx = me.target, me.ctx
    packed = target.packed_aux(result) if status == "ok" and target.packed_aux is not None else None
    tensors = dict(tap.captures)
    for rec in tap.allreduces:
        if rec.inp is not None and rec.out is not None:
            tensors[f"allreduce.{rec.seq}.in"], tensors[f"allreduce.{rec.seq}.out"] = rec.inp, rec.out
    tensors["input_ids"] = target.input_ids
    aux_meta = {}
    if packed is not None:
        aux_meta = {"shape": list(packed.shape), "dtype": str(packed.dtype).replace("torch.", ""),
                    "contiguous": packed.is_contiguous(), "stride": list(packed.stride())}
        tensors["aux.packed"] = packed
    meta = {
        "rank": ctx.rank, "world_size": ctx.world_size, "status": status, "error": error,
        "points": [_point_meta(n, tensors.get(n), tap.summaries.get(n)) for n in dict.fromkeys(tap.order)
                   if n in tensors or n in tap.summaries],
        "allreduces": [r.meta() for r in tap.allreduces], "unreduced_rows": tap.unreduced_rows(),
        "embed_module": tap.embed_name, "layers_hooked": len(tap.layer_indices),
        "aux": aux_meta, "params": replicated_param_hashes(target.model) if me.params is None else me.params,
        "timings": dict(me.timings), "device": str(ctx.device), "hidden": target.hidden_size,
    }
    if not me.keep_all:   # --exchange fingerprint: a few KB per capture travel, not the tensors
        fps = {n: f.to_json() for n, f in tap.summaries.items()}
        if packed is not None:
            fps["aux.packed"] = fingerprint(packed, seed=FP_SEED, k=FP_K).to_json()
        meta["fingerprints"] = fps
        from .exchange.fingerprint import TORCH_PATH
        if TORCH_PATH and ctx.device.type == "cuda":   # say why the fused kernel was not used
            meta["fingerprint_torch_path"] = dict(TORCH_PATH)
        for m, rec in zip(meta["allreduces"], tap.allreduces):
            if rec.inp_summary is not None and rec.out_summary is not None:
                m["in_fp"], m["out_fp"] = rec.inp_summary.to_json(), rec.out_summary.to_json()
        if packed is not None:
            from .checks.evidence import match_slots, slot_candidates
            cands = {n: tap.captures[n] if n in tap.captures else tap.summaries[n]
                     for n in slot_candidates(tap.order) if n in tap.captures or n in tap.summaries}
            meta["slot_match"] = match_slots(packed, target.hidden_size, cands, me.opts.torch_dtype)
    return tensors, meta


def _post_and_collect(me: _Rank, tensors: dict, meta: dict, files: list) -> dict:
    """Metadata through the store first, so ranks that died, hung or disagree never hang this one."""
    me.progress.set("exchange")
    ch, world = me.ch, me.ctx.world_size
    ch.post("meta", {"files": files, "status": meta["status"], "error": meta["error"],
                     "n_allreduce": len(meta["allreduces"]), "meta": meta,
                     "index": {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in tensors.items()}})
    deadline = time.time() + (me.grace if meta["status"] == "error" else me.opts.timeout)
    return ch.collect("meta", deadline, stop_early=lambda found: _all_missing_explained(ch, found, world))


def _exchange(me: _Rank, tensors: dict, meta: dict, posts: dict):
    """The tensors (or what the checks need of them) to rank 0; bytes moved are posted for the report."""
    ctx, world = me.ctx, me.ctx.world_size
    all_ok = len(posts) == world and all(p["status"] == "ok" for p in posts.values())
    t1 = time.time()
    evidence, moved = None, {"sent": 0, "received": 0}
    if all_ok and not me.keep_all and world > 1:
        from .checks.evidence import FingerprintEvidence
        from .exchange.gather import exchange_fingerprint
        records, detail, moved = exchange_fingerprint(ctx, me.ch, tensors, meta, posts, me.opts.torch_dtype)
        if ctx.rank == 0:
            evidence = FingerprintEvidence(records, me.opts.torch_dtype, detail)
    else:
        records = _gather(me.opts, ctx, me.out, tensors, meta, posts, all_ok)
        if all_ok and world > 1:
            from .exchange.gather import gather_plan
            sent = sum(_nbytes(shape, wire) for _, shape, wire, _ in gather_plan(posts))
            moved = {"sent": sent, "received": 0} if ctx.rank else {"sent": 0, "received": sent * (world - 1)}
    me.timings["exchange_s"] = time.time() - t1
    me.ch.post("bytes", {"sent": moved["sent"] + len(json.dumps(posts.get(ctx.rank, {}))),
                         "received": moved["received"] + sum(len(json.dumps(p)) for r, p in posts.items()
                                                             if r != ctx.rank),
                         "tensor_sent": moved["sent"], "tensor_received": moved["received"],
                         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
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
    liveness = {"missing": {r: _missing_info(ch, r, posts) for r in range(world) if r not in posts}}
    if me.ctx.backend == "nccl" and (liveness["missing"] or any(p["status"] != "ok" for p in posts.values())):
        liveness["flight_recorder"] = _flight_recorders(me)
    settings = _settings(me)
    references = _references(me.opts) if me.target.arch == "builtin" else None
    t2 = time.time()
    result = run_checks(records, settings, liveness, references, evidence=evidence)
    from .report.model import build_report
    from .report.emit import emit
    report = build_report(settings, result, timings={**me.timings, "check_s": time.time() - t2,
                                                     "total_s": time.time() - me.t_start}, out=str(me.out))
    if liveness.get("flight_recorder"):
        report["flight_recorder"] = liveness["flight_recorder"]
    report["exchange"] = {"mode": me.opts.exchange, "bytes_per_rank": ch.collect("bytes", time.time() + me.grace),
                          "captured_bytes_per_rank": sum(t.numel() * t.element_size() for t in tensors.values())}
    torch_path = {r: p["meta"]["fingerprint_torch_path"] for r, p in posts.items()
                  if p.get("meta", {}).get("fingerprint_torch_path")}
    if torch_path:
        report["exchange"]["fingerprint_torch_path"] = torch_path
    capture.write_manifest(me.out, {"world_size": world, "ranks": sorted(posts), "settings": settings,
                                    "tool": report["tool"]}, [f for p in posts.values() for f in p["files"]])
    emit(report, me.out, me.opts)
    return exit_code(report["findings"])


def estimate_capture_bytes(target: ProbeTarget, layer_ids: list[int], keep_all: bool) -> int:
    """What one rank writes: embedding (local + out), the kept layers, the packed aux, and with
    --exchange full every layer plus two tensors per audited all-reduce (about 2 per layer)."""
    per = int(target.input_ids.numel()) * target.hidden_size * torch.empty((), dtype=target.dtype).element_size()
    n = 3 + len(layer_ids) + len(layer_ids)
    if keep_all:
        n += target.num_layers + 2 * (2 * target.num_layers + 1)
    return n * per


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _agree_out_dir(opts, ctx, ch) -> str:
    """Rank 0 picks the folder (the launcher passes it down); every rank uses the same one."""
    if ctx.rank == 0:
        out = opts.out or time.strftime("tpprobe-runs/%Y%m%d-%H%M%S-") + os.urandom(2).hex()
        capture.check_out_dir(Path(out), 0)
        ch.post("out", {"out": out}, rank=0)
        return out
    deadline = time.time() + opts.timeout
    v = None
    while v is None and time.time() < deadline:
        v = ch.get("out", 0)
        if v is None and ch.get("ready", 0) is not None:   # rank 0 failed before choosing
            break
        time.sleep(0.05)
    if v is None:
        raise UsageError("rank 0 did not say where to write the capture (did it fail to start?)")
    Path(v["out"]).mkdir(parents=True, exist_ok=True)
    return v["out"]


def _all_missing_explained(ch: Channel, found: dict, world: int) -> bool:
    """Stop waiting early when every missing rank is known dead (silent) or stalled in a collective
    none of the others will issue."""
    now = time.time()
    for r in range(world):
        if r in found:
            continue
        stall = ch.get("stall", r)
        if stall and all(p["n_allreduce"] <= stall["collective"]["seq"] for p in found.values()):
            continue
        hb = ch.get("hb", r)
        if hb is not None and now - hb["t"] > 3.0:
            continue
        return False
    return bool(found)


def _flight_recorders(me: _Rank) -> dict:
    """Every live rank's NCCL flight recorder summary (its watchdog posts it on request): which
    collective sequence number each rank's NCCL scheduled, started and completed."""
    me.ch.post("fr-request", {}, rank=0)
    alive = {r for r in range(me.ctx.world_size) if r != 0 and me.ch.get("meta", r) is not None}
    got = me.ch.collect("fr", time.time() + min(1.5, me.grace), stop_early=lambda found: alive <= set(found))
    got[0] = me.flight or dist_mod.flight_recorder() or {}
    return {r: v for r, v in sorted(got.items()) if v}


def _missing_info(ch: Channel, r: int, posts: dict) -> dict:
    hb, stall = ch.get("hb", r), ch.get("stall", r)
    info = {"heartbeat": hb, "stall": stall}
    if hb is None and ch.get("ready", r) is not None:
        info["heartbeat"] = {"phase": "forward"}
        info["state"] = "died (it built its model, then went silent)"
    elif hb is None:
        info["state"] = "never started the probe (no heartbeat)"
    else:
        info["silent_s"] = time.time() - hb["t"]
        info["state"] = "hung (alive, no progress)" if info["silent_s"] < 2.0 else "died (heartbeat stopped)"
    return info


def _gather(opts, ctx, out: Path, tensors: dict, meta: dict, posts: dict, all_ok: bool) -> dict:
    """Rank 0 gets every rank's record: collectives when every rank is healthy, else the files."""
    if ctx.world_size == 1:
        return {0: capture.RankRecord(0, meta, tensors)}
    if all_ok:
        from .exchange.gather import gather_full
        return gather_full(ctx, tensors, meta, posts)
    if ctx.rank != 0:
        return {}
    # some rank is missing or failed: no collective is safe; read what the others wrote
    records = {0: capture.RankRecord(0, meta, tensors)}
    for r in posts:
        if r == 0:
            continue
        try:
            records[r] = capture.load_rank_files(out, r, posts[r]["files"])
        except TPProbeError:
            pass   # checks report this rank from its posted metadata alone
    return records


def _point_meta(name, t, fp) -> dict:
    if t is not None:
        return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "kept": True}
    return {"name": name, "shape": list(fp.shape), "dtype": fp.dtype, "kept": False}


def _nbytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _await_final(ch: Channel, wait: float) -> int:
    v = ch.collect_rank("final", 0, time.time() + wait)
    return int(v["code"]) if v else 1


def builtin_config(opts: ProbeOptions, layer_ids: Optional[list[int]] = None):
    return BuiltinConfig(num_layers=opts.num_layers, hidden=opts.hidden, heads=opts.heads, ffn=opts.ffn,
                         vocab=opts.vocab, tokens=opts.tokens, seed=opts.seed, dtype=opts.torch_dtype,
                         **({"layer_ids": layer_ids} if layer_ids is not None else {}))


def _references(opts):
    from .model import reference_streams
    return reference_streams(builtin_config(opts))


def _on_sigterm(signum, frame):
    # The elastic agent sends SIGTERM to every worker once one worker failed. We are already on our
    # way to report that failure (the dead peer breaks our collectives); keep going. SIGKILL follows
    # after the agent's grace period if we do not finish.
    pass
