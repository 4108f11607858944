"""The checks on a capture folder read back (`tpprobe report DIR`): the live probe's `run_checks`, on the files,
with no process running, and the folder's own problems (a file missing, truncated, corrupted or extra) as
findings before anything computed from what is left."""
from __future__ import annotations

from typing import Optional

from ..capture.points import SHARE, parse
from ..formats.capture_dir import LoadedRun
from .findings import FAILURE, WARNING, Finding
from .run import capture_mismatches, run_checks


def fingerprint_evidence(records: dict, settings: dict):
    """A capture taken with --exchange fingerprint keeps tensors for the requested slots only; every
    other point has its fingerprint in the metadata. Judge it as the live probe did: fingerprints,
    with exact statistics from the tensors where both sides kept one. None for full captures."""
    if not records or not all(r.meta.fingerprints is not None for r in records.values()):
        return None
    from ..core.noise import compare, dtype_from_str, judge_dtype
    from .evidence import FingerprintEvidence
    dtype = dtype_from_str(settings.get("dtype", "float32"))
    ref = min(records)
    detail: dict = {}
    for name, base in records[ref].tensors.items():
        for r, rec in records.items():
            t = rec.tensors.get(name)
            if r != ref and t is not None and t.shape == base.shape and parse(name).kind != SHARE:
                detail.setdefault(name, {})[r] = compare(t, base, dtype=judge_dtype(t.dtype, base.dtype, dtype))
    return FingerprintEvidence(records, dtype, detail)


def run_settings(run: LoadedRun) -> dict:
    """The run's settings as its manifest has them (the world size and hidden size filled in when absent)."""
    settings = dict(run.manifest.get("settings") or {})
    settings.setdefault("world_size", run.manifest["world_size"])
    settings.setdefault("hidden", next((r.meta.hidden for r in run.records.values() if r.meta.hidden), 0))
    return settings


def check_run(run: LoadedRun, offset_rule: bool = True) -> tuple[dict, dict]:
    """(settings, the checks' result) of one capture folder (one forward of one TP group); `offset_rule` as
    `run_checks` takes it (the run's engine says: tpprobe.engines.registry.recorded)."""
    settings = run_settings(run)
    world = run.manifest["world_size"]
    # a rank the live run saw die or hang keeps that diagnosis; any other missing rank is a file problem
    seen = {int(r): v for r, v in (run.manifest.get("liveness") or {}).items()}
    missing = {r: seen.get(r, {"state": "has no readable capture in this folder"})
               for r in range(world) if r not in run.records}
    unexplained = [r for r in missing if r not in seen]
    result = run_checks(run.records, settings, {"missing": missing} if missing else None,
                        evidence=fingerprint_evidence(run.records, settings), offset_rule=offset_rule)
    if unexplained:
        # a rank without a readable file is not a dead rank: name the files, not a timeout
        result["findings"] = [f for f in result["findings"]
                              if f["kind"] != "rank-timeout" or not set(f["ranks"]) & set(unexplained)]
    findings = file_findings(run, unexplained)
    # ranks that captured different points / shapes / dtypes (unless the checks said so already)
    if not any(f["kind"] == "capture-mismatch" for f in result["findings"]):
        findings += capture_mismatches(run.records)
    result["findings"] = [f.to_json() for f in findings] + result["findings"]
    return settings, result


def file_findings(run: LoadedRun, unexplained: Optional[list[int]] = None) -> list[Finding]:
    """One finding per file of the folder that is missing, truncated, corrupted or extra (a warning), and per
    rank in `unexplained` that has no capture file at all."""
    out = [Finding("capture-file", p["file"], [p["rank"]] if p["rank"] is not None else [],
                   severity=FAILURE if "extra" not in p["problem"] else WARNING, detail=p["problem"])
           for p in run.problems]
    for r in unexplained or []:
        if not any(p["rank"] == r for p in run.problems):
            out.append(Finding("capture-file", f"rank {r}", [r],
                               detail="no capture file for this rank in the manifest"))
    return out
