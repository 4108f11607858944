"""`tpprobe report DIR`: the same checks as the live probe, on the files, with no process running."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..formats.capture_dir import load_run, point_set_mismatches
from ..capture.points import SHARE, parse
from ..checks.run import run_checks
from ..checks.findings import FAILURE, Finding
from ..report.model import build_report
from ..probe.report import probe_report
from ..report.emit import Flags, emit


def fingerprint_evidence(records: dict, settings: dict):
    """A capture taken with --exchange fingerprint keeps tensors for the requested slots only; every
    other point has its fingerprint in the metadata. Judge it as the live probe did: fingerprints,
    with exact statistics from the tensors where both sides kept one. None for full captures."""
    if not records or not all("fingerprints" in r.meta for r in records.values()):
        return None
    from ..core.noise import compare, dtype_from_str
    from ..checks.evidence import FingerprintEvidence
    from ..core.noise import judge_dtype
    dtype = dtype_from_str(settings.get("dtype", "float32"))
    ref = min(records)
    detail: dict = {}
    for name, base in records[ref].tensors.items():
        for r, rec in records.items():
            t = rec.tensors.get(name)
            if r != ref and t is not None and t.shape == base.shape and parse(name).kind != SHARE:
                detail.setdefault(name, {})[r] = compare(t, base, dtype=judge_dtype(t.dtype, base.dtype, dtype))
    return FingerprintEvidence(records, dtype, detail)


def report_dir(path: Path, json_out: bool = False, html: Optional[str] = None, markdown: Optional[str] = None,
               quiet: bool = False) -> int:
    from ..formats.capture_dir import check_file_path
    for flag, out in (("--html", html), ("--markdown", markdown)):
        if out:
            check_file_path(Path(out), flag)
    path = Path(path)
    if path.is_dir() and not (path / "manifest.json").exists():
        from .steps import find_steps, report_steps
        if find_steps(path):      # the SGLang plugin's run: many steps, maybe many TP groups
            return report_steps(path, check_dir, json_out=json_out, html=html, markdown=markdown, quiet=quiet)
    rep = check_dir(path)
    damaged = damaged_files(rep)
    if damaged:
        # a folder with damaged files is unreadable input: its checks would compare what is left and its
        # own report.json speaks of the run before the damage. One line; --json still gives the rest.
        rep["exit_code"] = 2
        if json_out:
            emit(probe_report(rep), None, Flags(json_out=True))
            return 2
        from ..core.errors import CaptureError
        readable = sorted({int(r) for p in rep["points"] for r in p.get("per_rank", {})})
        shown = "; ".join(damaged[:4]) + (f"; and {len(damaged) - 4} more" if len(damaged) > 4 else "")
        kept = (f"rank {readable[0]} is" if len(readable) == 1 else f"ranks {', '.join(map(str, readable))} are") \
            + " still readable (--json shows them); " if readable else ""
        raise CaptureError(f"{path}: damaged capture folder, nothing compared: {shown}; {kept}re-run the probe "
                           f"or copy the folder again")
    from ..formats.acceptance import attach
    attach(rep, path)       # the engine's own acceptance beside a step folder, when the plugin wrote it
    emit(probe_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown, quiet=quiet))
    return rep["exit_code"]


def damaged_files(rep: dict) -> list[str]:
    """`rank-001.safetensors (rank 1): missing` for each file of the folder that is missing, truncated or
    unreadable (an extra file is a warning, not damage)."""
    return [f"{f['where']}" + (f" (rank {f['ranks'][0]})" if f["ranks"] and f"rank {f['ranks'][0]}" != f["where"]
                               else "") + f": {f['detail']}"
            for f in rep["findings"] if f["kind"] == "capture-file" and f["severity"] == FAILURE]


def check_dir(path: Path) -> dict:
    """The report of one capture folder (one forward of one TP group), not printed."""
    run = load_run(path)
    settings = dict(run.manifest.get("settings") or {})
    settings.setdefault("world_size", run.manifest["world_size"])
    settings.setdefault("hidden", next((r.meta.get("hidden") for r in run.records.values() if r.meta.get("hidden")), 0))
    # a rank the live run saw die or hang keeps that diagnosis; any other missing rank is a file problem
    seen = {int(r): v for r, v in (run.manifest.get("liveness") or {}).items()}
    missing = {r: seen.get(r, {"state": "has no readable capture in this folder"})
               for r in range(run.manifest["world_size"]) if r not in run.records}
    unexplained = [r for r in missing if r not in seen]
    from ..engines.registry import recorded
    result = run_checks(run.records, settings, {"missing": missing} if missing else None,
                        evidence=fingerprint_evidence(run.records, settings),
                        offset_rule=recorded(settings).offset_rule)
    # unreadable files are findings of their own, before anything computed from what is left
    file_findings = [Finding("capture-file", p["file"], [p["rank"]] if p["rank"] is not None else [],
                             severity=FAILURE if "extra" not in p["problem"] else "warning",
                             detail=p["problem"]).to_json() for p in run.problems]
    if unexplained:
        # a rank without a readable file is not a dead rank: name the files, not a timeout
        result["findings"] = [f for f in result["findings"]
                              if f["kind"] != "rank-timeout" or not set(f["ranks"]) & set(unexplained)]
        for r in unexplained:
            if not any(p["rank"] == r for p in run.problems):
                file_findings.append(Finding("capture-file", f"rank {r}", [r],
                                             detail="no capture file for this rank in the manifest").to_json())
    # ranks that captured different points / shapes / dtypes (unless the checks said so already)
    if not any(f["kind"] == "capture-mismatch" for f in result["findings"]):
        file_findings += [Finding("capture-mismatch", m["point"], m["ranks"], detail=m["detail"]).to_json()
                          for m in point_set_mismatches({r: rec.meta for r, rec in run.records.items()})]
    result["findings"] = file_findings + result["findings"]
    rep = build_report(settings, result, timings=dict(run.manifest.get("timings") or {}), out=str(path))
    rep["offline"] = True
    return rep
