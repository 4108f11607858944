"""The watch (TPPROBE_WATCH=N): one forward in N checked on every TP rank for as long as the engine serves.

Both engines' plugins (tpprobe/engines/vllm/worker.py, tpprobe/engines/sglang/plugin.py) call `watched(step)`
and `forward(...)` from their forward wrapper; everything else is here. A checked forward runs the plugins'
own fingerprint capture (the Tap: embedding, decoder layers, every collective's input and output at the
engine's door, tpprobe/capture/audit) and keeps nothing but fingerprints; each rank's record (a few KB of
JSON) is all-gathered over the TP group's CPU group, and every rank runs the same checks `tpprobe report`
runs (tpprobe/checks/run.py) on the same records, so every rank reaches the same verdict with no second
collective. Whether a forward is checked depends on its index and N only (the same on every rank).

A healthy checked forward leaves only counts. A forward with a finding is printed once by TP rank 0 as one
line in the engine's log (`[tpprobe] step 1234: allreduce-incomplete at layer 2 (...o_proj) on rank(s) [1]:
...`) and kept as a step folder `tpprobe report` reads (DIR/dp{D}-pp{P}/step-{N:06d}-{mode}/: each rank
writes its own rank file where it runs, TP rank 0 the manifest), while the total kept per rank stays under
TPPROBE_MAX_BYTES (a record past it is counted, not kept). Every rank keeps a rolling summary,
DIR/dp{D}-pp{P}/watch-rank-{R:03d}.json (forwards checked, healthy, the failing steps, first and last step
checked), rewritten after each failing step and at most once a second otherwise; so a folder says which
ranks it held, and `tpprobe report DIR1 DIR2` merges per-node folders (tpprobe/cli/watch_report.py).

Nothing hangs and the engine never stops: an error of the watch on any rank (the Tap, the record, the
check) travels in that forward's exchange, or when it happened after it (a write: a full disk, an
unwritable folder), in the next checked forward's, where every rank learns it and all stop watching
together; TP rank 0 says it in one line. The model's own errors are raised as they are.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

SCHEMA = "tpprobe.watch/1"
DEFAULT_EVERY = 512         # bench/vllm_watch.py: a checked forward costs ~8 CPU-engine forwards; /512: < 2 %
MAX_LINES = 32              # log lines of findings per process; later ones are kept in the folder only
MAX_LISTED = 256            # failing steps listed in a summary; later ones counted
FLUSH_S = 1.0               # a healthy summary is rewritten at most this often

# process-wide by nature: one engine worker process serves one TP rank; this is its watch
_W: dict = {"every": 0, "checked": 0, "healthy": 0, "failing": 0, "listed": [], "not_kept": 0, "first": None,
            "last": None, "stopped": None, "pending": None, "bytes": None, "lines": 0, "flushed": 0.0,
            "check_s": 0.0, "side": None, "announced": False, "configured": False,
      "phases": {}, "warned": 0, "warning": None}
_busy = threading.local()


def say(msg: str) -> None:
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Side:
    """What the watch needs of an engine: this rank in its TP group, the group's CPU (gloo) group, the
    parallel ranks for the folder's name, the Tap extensions, and the engine's name in records."""
    rank: int
    world: int
    cpu_group: object
    par: dict
    extensions: tuple
    source: str                        # "vllm-watch", "sglang-watch"
    backend: str
    root: Path
    max_bytes: int
    tap_setup: Callable = field(default=lambda tap: None)

    @property
    def group_dir(self) -> Path:
        return self.root / f"dp{self.par.get('dp_rank', 0)}-pp{self.par.get('pp_rank', 0)}"


EVERY_TAKES = f"N >= 1 forwards, 0 / off, or on (= {DEFAULT_EVERY})"


def read_every(text) -> Optional[int]:
    """N from TPPROBE_WATCH or the toggle: an integer >= 0, "on" / "default" (DEFAULT_EVERY) or "off" / "" (0);
    None for anything else."""
    t = str(text).strip().lower()
    if t in ("", "0", "off", "false", "no"):
        return 0
    if t in ("on", "default", "true", "yes"):
        return DEFAULT_EVERY
    if t.isdigit():
        return int(t)
    return None


def parse_every(text) -> int:
    """`read_every` for the live toggle (tpprobe_watch): anything unreadable is off, said once (a setting never
    stops the engine). At the plugin's start an unreadable TPPROBE_WATCH turns the plugin off instead
    (tpprobe/engines/sglang/options.py)."""
    n = read_every(text)
    if n is not None:
        return n
    if not _W.get("bad_said"):
        _W["bad_said"] = True
        say(f"TPPROBE_WATCH={text!r} is not a number of forwards (N >= 1, 0 / off, or on = {DEFAULT_EVERY}): "
            f"the watch stays off")
    return 0


def configure(every: Optional[int]) -> None:
    """The watch's N from the settings (TPPROBE_WATCH), once per process: 0 / None = off."""
    if not _W["configured"]:
        _W["configured"] = True
        _W["every"] = max(0, int(every or 0))


def watched(step: int) -> bool:
    """Whether forward `step` is checked: the same answer on every rank of the TP group."""
    return _W["every"] > 0 and _W["stopped"] is None and step % _W["every"] == 0 \
        and not getattr(_busy, "on", False)


def set_every(n: int) -> dict:
    """Toggle on a live engine (every rank between the same two forwards: the engines' collective RPCs are
    ordered with their steps): check one forward in `n` from now on; 0 = off. A watch stopped by an error
    stays stopped."""
    _W["every"], _W["configured"] = parse_every(n), True
    say((f"watch: one forward in {_W['every']} checked from now on" if _W["every"] else "watch: off")
        + (f" (NOT: stopped earlier: {_W['stopped']})" if _W["stopped"] else ""))
    flush(force=True)
    return status()


def stop(reason: str) -> None:
    """Stop the watch in this process (one line)."""
    if _W["stopped"] is None:
        _W["stopped"] = reason
        say(f"watch stopped: {reason}; the engine goes on")


def status() -> dict:
    side = _W["side"]
    return {"every": _W["every"], "checked": _W["checked"], "healthy": _W["healthy"], "failing": _W["failing"],
            "first_step": _W["first"], "last_step": _W["last"], "findings": [dict(x) for x in _W["listed"][-8:]],
            "not_kept": _W["not_kept"], "stopped": _W["stopped"], "check_s": round(_W["check_s"], 4),
            "warned": _W["warned"], "warning": _W["warning"],
            "seconds": {k: round(v, 4) for k, v in _W["phases"].items()},
            "summary": str(summary_path(side)) if side else None}


def summary_path(side: Side) -> Path:
    return side.group_dir / f"watch-rank-{side.rank:03d}.json"


def flush(force: bool = False) -> None:
    """Rewrite this rank's summary (atomically); an error stops the watch at the next exchange."""
    side = _W["side"]
    if side is None or _W["stopped"] is not None and not force:
        return
    now = time.time()
    if not force and now - _W["flushed"] < FLUSH_S:
        return
    _W["flushed"] = now
    from tpprobe.formats.capture_dir import atomic_write_bytes

    doc = {"schema": SCHEMA, "source": side.source, "rank": side.rank, "world_size": side.world,
           "parallel": side.par, "every": _W["every"], "checked": _W["checked"], "healthy": _W["healthy"],
           "failing": _W["failing"], "first_step": _W["first"], "last_step": _W["last"], "findings": _W["listed"],
           "not_kept": _W["not_kept"], "stopped": _W["stopped"], "pid": os.getpid(), "updated": now,
           "warned": _W["warned"], "warning": _W["warning"],
           "seconds": {k: round(v, 4) for k, v in _W["phases"].items()}}
    try:
        side.group_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(summary_path(side), json.dumps(doc, indent=1, default=str).encode())
    except Exception as e:  # noqa: BLE001 - a full disk or an unwritable folder: the watch stops, never the engine
        if _W["pending"] is None and _W["stopped"] is None:
            _W["pending"] = f"summary not written: {type(e).__name__}: {e}"


class _NoKeep:
    """The watch keeps no tensor: every point and collective is a fingerprint."""
    refused: list = []

    @staticmethod
    def match(name: str) -> bool:
        return False

    @staticmethod
    def admit(name: str, t) -> bool:
        return False


def forward(side: Side, model, run: Callable, input_ids: torch.Tensor, mode: str, step: int):
    """One checked forward on this rank: the model's forward inside the Tap, the exchange, the check.
    Returns the model's result; the model's own error is raised as it is."""
    box: dict = {}

    def run_once():
        try:
            box["result"] = run()
        except BaseException as e:
            box["model_error"] = e
            raise
        return box["result"]

    if _W["side"] is None:
        _W["side"] = side
        if _W["bytes"] is None:
            _W["bytes"] = [0] * side.world
    if not _W["announced"]:
        _W["announced"] = True
        if side.rank == 0:
            say(f"watch on: one forward in {_W['every']} checked on every TP rank ({side.world}), findings kept "
                f"in {side.group_dir} (<= {side.max_bytes} bytes/rank); `tpprobe report {side.root}`")
    error = _W["pending"]
    tap, t0 = None, time.time()
    if error is None:
        try:
            tap = _tap_forward(side, model, run_once, input_ids, box)
        except BaseException as e:  # noqa: BLE001
            if "model_error" in box:
                raise
            error = f"{type(e).__name__}: {e}"
    if "result" not in box:          # the Tap failed before the model ran: the forward (its collectives) first
        run_once()
    t_forward = time.time() - t0
    try:
        _exchange_and_check(side, model, tap, input_ids, mode, step, t_forward, error)
    except Exception as e:  # noqa: BLE001 - after the exchange: the next checked forward's exchange says it
        if _W["pending"] is None:
            _W["pending"] = f"{type(e).__name__}: {e}"
    _W["check_s"] += time.time() - t0 - t_forward
    if _W["every"] > 1 or _W["stopped"]:
        from tpprobe.capture.audit import release
        release()        # the forwards in between run their collectives with no Python of ours
    return box["result"]


def _tap_forward(side: Side, model, run_once, input_ids, box):
    from tpprobe.capture.hooks import Tap
    from tpprobe.capture.record import resolve_summaries
    from tpprobe.fingerprint.reference import PROBE_K, PROBE_SEED, Deferred

    fps = Deferred(PROBE_SEED, PROBE_K)
    _busy.on = True
    try:
        with torch.no_grad(), Tap(model, extensions=side.extensions, input_ids=input_ids, keep=_NoKeep.match,
                                  admit=_NoKeep.admit, keep_allreduce_tensors=False, summarize=fps) as tap:
            side.tap_setup(tap)
            run_once()
        resolve_summaries(tap, fps, True)
        from tpprobe.config.knobs import knob

        if knob("TPPROBE_VLLM_INJECT") == f"plugin-error@{side.rank}":
            raise RuntimeError(f"TPPROBE_VLLM_INJECT=plugin-error@{side.rank}: a fault in the watch's own code")
        return tap
    finally:
        _busy.on = False


def _record(side: Side, model, tap, input_ids, mode, step, t_forward) -> tuple[dict, dict]:
    from tpprobe.engines.step import step_record, step_settings

    record = step_record(tap, model=model, rank=side.rank, world=side.world, input_ids=input_ids, aux=None,
                         budget=_NoKeep, t_forward=t_forward,
                         extra={"source": side.source, "step": step, "forward_mode": mode,
                                "model": type(model).__name__, "parallel": side.par, "budget_refused": []})
    settings = step_settings(record, model, backend=side.backend, tokens=int(input_ids.shape[0]), mode=mode,
                             step=step, par=side.par, slots=([], []), extra={"watch_every": _W["every"]})
    return record.to_json(), settings


def _files(rank: int, meta: dict) -> list[tuple[str, bytes]]:
    """This rank's two files of a kept step, as bytes (the manifest's sizes and digests are computed from
    the same bytes on TP rank 0, which has every rank's record from the exchange)."""
    import struct

    from tpprobe.formats.capture_dir import SCHEMA as CAPTURE_SCHEMA, rank_stem

    # a safetensors file holding no tensor, written byte for byte here (safetensors' own writer orders the
    # metadata differently from one process to the next): its 8-byte header length, then the header, padded
    header = json.dumps({"__metadata__": {"rank": str(rank), "schema": CAPTURE_SCHEMA}}, separators=(",", ":"))
    header += " " * (-len(header) % 8)
    stem = rank_stem(rank)
    return [(f"{stem}.safetensors", struct.pack("<Q", len(header)) + header.encode()),
            (f"{stem}.json", json.dumps(meta, indent=1, default=str).encode())]


def _entries(rank: int, meta: dict) -> list[dict]:
    import hashlib

    return [{"path": name, "rank": rank, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in _files(rank, meta)]


def check(metas: dict[int, dict], settings: dict) -> dict:
    """The checks `tpprobe report` runs on a step folder, on the exchanged records (fingerprints only)."""
    from tpprobe.checks.evidence import FingerprintEvidence
    from tpprobe.checks.run import run_checks
    from tpprobe.core.noise import dtype_from_str
    from tpprobe.formats.capture_dir import LoadedRank

    records = {r: LoadedRank(r, m, {}) for r, m in metas.items()}
    evidence = FingerprintEvidence(records, dtype_from_str(settings.get("dtype", "float32")), {})
    from tpprobe.engines.registry import recorded
    return run_checks(records, settings, None, evidence=evidence, offset_rule=recorded(settings).offset_rule)


def line(step: int, mode: str, f: dict) -> str:
    ranks = f.get("ranks") or []
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    detail = " ".join(str(f.get("detail") or "").split())
    return f"[tpprobe] step {step} ({mode}): {f['kind']} at {f['where']} on {who}: {detail[:400]}"


def _spent(phase: str, t0: float) -> float:
    """Add the seconds since t0 to `phase` (the summary's `seconds`: where a checked forward's time goes)."""
    now = time.perf_counter()
    _W["phases"][phase] = _W["phases"].get(phase, 0.0) + now - t0
    return now


def _exchange_and_check(side: Side, model, tap, input_ids, mode, step, t_forward, error) -> None:
    _W["phases"]["forward (in the Tap)"] = _W["phases"].get("forward (in the Tap)", 0.0) + t_forward
    t = time.perf_counter()
    meta, settings = ({}, {})
    if error is None:
        try:
            meta, settings = _record(side, model, tap, input_ids, mode, step, t_forward)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    mine = (meta, settings, error)
    t = _spent("record", t)
    if side.world > 1:
        gathered = [None] * side.world
        torch.distributed.all_gather_object(gathered, mine, group=side.cpu_group)
    else:
        gathered = [mine]
    errors = [(r, g[2]) for r, g in enumerate(gathered) if g[2] is not None]
    t = _spent("exchange", t)
    if errors:          # every rank saw the same list: all stop together
        _W["stopped"] = f"step {step}: rank(s) {[r for r, _ in errors]}: {errors[0][1]}"
        if side.rank == 0:
            say(f"watch FAILED at step {step} ({mode}) on tp rank(s) {[r for r, _ in errors]}: {errors[0][1]}; "
                f"the watch stops on every rank, the engine goes on")
        flush(force=True)
        return
    metas = {r: g[0] for r, g in enumerate(gathered)}
    result = check(metas, {**gathered[0][1], "world_size": side.world})
    _spent("check", t)
    _W["checked"] += 1
    _W["first"] = step if _W["first"] is None else _W["first"]
    _W["last"] = step
    fails = [f for f in result["findings"] if f["severity"] == "failure"]
    if not fails:
        warns = [f for f in result["findings"] if f["severity"] == "warning"]
        if warns:       # not healthy either: a point or a collective was not checked (coverage)
            _W["warned"] += 1
            if _W["warning"] is None:
                _W["warning"] = {"step": step, "kind": warns[0]["kind"], "where": warns[0]["where"],
                                 "detail": str(warns[0].get("detail") or "")[:400]}
                if side.rank == 0:
                    say(f"watch: step {step} ({mode}) checked with a warning (said once): {warns[0]['kind']} at "
                        f"{warns[0]['where']}: {_W['warning']['detail']}")
        else:
            _W["healthy"] += 1
        flush()
        return
    _W["failing"] += 1
    sizes = [sum(e["size"] for e in _entries(r, metas[r])) for r in range(side.world)]
    keep = all(_W["bytes"][r] + sizes[r] <= side.max_bytes for r in range(side.world))
    folder = _keep(side, metas, gathered[0][1], mode, step) if keep else None
    if keep:
        _W["bytes"] = [b + s for b, s in zip(_W["bytes"], sizes)]
    else:
        _W["not_kept"] += 1
    f0 = fails[0]
    if len(_W["listed"]) < MAX_LISTED:
        _W["listed"].append({"step": step, "forward_mode": mode, "kind": f0["kind"], "where": f0["where"],
                             "ranks": f0["ranks"], "detail": str(f0.get("detail") or "")[:400],
                             "failures": len(fails), "folder": folder})
    if side.rank == 0 and _W["lines"] < MAX_LINES:
        _W["lines"] += 1
        print(line(step, mode, f0) + ("" if keep else " (record not kept: TPPROBE_MAX_BYTES reached)")
              + (f"; {len(fails) - 1} more finding(s) in this step" if len(fails) > 1 else "")
              + ("" if _W["lines"] < MAX_LINES else f"; later findings are kept in {side.group_dir} only"),
              file=sys.stderr, flush=True)
    flush(force=True)


def _keep(side: Side, metas: dict, settings: dict, mode: str, step: int) -> str:
    """The failing step's folder: this rank's files; TP rank 0's manifest names every rank's."""
    from tpprobe import __version__
    from tpprobe.formats.capture_dir import atomic_write_bytes, write_manifest

    out = side.group_dir / step_name(step, mode)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, data in _files(side.rank, metas[side.rank]):
            atomic_write_bytes(out / name, data)
        if side.rank == 0:
            files = [e for r in sorted(metas) for e in _entries(r, metas[r])]
            write_manifest(out, {"world_size": side.world, "ranks": sorted(metas), "settings": settings,
                                 "tool": f"tpprobe {__version__}", "source": side.source, "step": step,
                                 "forward_mode": mode, "model": settings.get("model")}, files)
    except Exception as e:  # noqa: BLE001 - the next exchange stops the watch on every rank
        if _W["pending"] is None:
            _W["pending"] = f"step {step} not written: {type(e).__name__}: {e}"
    return str(out.relative_to(side.root))


def step_name(step: int, mode: str) -> str:
    """`step-{N:06d}-{mode}`, the plugins' step folder name (engines/sglang/plugin.py step_name, which the
    report reads): the mode lower case, anything but [a-z0-9_] made `_`."""
    import re

    safe = re.sub(r"[^a-z0-9_]+", "_", str(mode).lower()).strip("_") or "unknown"
    return f"step-{step:06d}-{safe}"


def reset_for_tests() -> None:
    """A fresh watch in this process (the SGLang tests run several engines' worth of forwards in one)."""
    _W.update(every=0, checked=0, healthy=0, failing=0, listed=[], not_kept=0, first=None, last=None, stopped=None,
              pending=None, bytes=None, lines=0, flushed=0.0, check_s=0.0, side=None, announced=False, configured=False,
              phases={}, warned=0, warning=None)
