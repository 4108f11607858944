"""`tpprobe report DIR`: the same checks as the live probe, on the files, with no process running."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .capture import load_run, point_set_mismatches
from .checks import run_checks
from .findings import FAILURE, Finding
from .report import build_report, emit


def report_dir(path: Path, json_out: bool = False, html: Optional[str] = None, markdown: Optional[str] = None,
               quiet: bool = False) -> int:
    run = load_run(path)
    settings = dict(run.manifest.get("settings") or {})
    settings.setdefault("world_size", run.manifest["world_size"])
    settings.setdefault("hidden", next((r.meta.get("hidden") for r in run.records.values() if r.meta.get("hidden")), 0))
    missing = {r: {"state": "has no readable capture in this folder"} for r in range(run.manifest["world_size"])
               if r not in run.records}
    result = run_checks(run.records, settings, {"missing": missing} if missing else None)
    # unreadable files are findings of their own, before anything computed from what is left
    file_findings = [Finding("capture-file", p["file"], [p["rank"]] if p["rank"] is not None else [],
                             severity=FAILURE if "extra" not in p["problem"] else "warning",
                             detail=p["problem"]).to_json() for p in run.problems]
    if missing:
        # a rank without a readable file is not a dead rank: name the files, not a timeout
        result["findings"] = [f for f in result["findings"] if f["kind"] != "rank-timeout"]
        for r in missing:
            if not any(p["rank"] == r for p in run.problems):
                file_findings.append(Finding("capture-file", f"rank {r}", [r],
                                             detail="no capture file for this rank in the manifest").to_json())
    # ranks that captured different points / shapes / dtypes (unless the checks said so already)
    if not any(f["kind"] == "capture-mismatch" for f in result["findings"]):
        file_findings += [Finding("capture-mismatch", m["point"], m["ranks"], detail=m["detail"]).to_json()
                          for m in point_set_mismatches({r: rec.meta for r, rec in run.records.items()})]
    result["findings"] = file_findings + result["findings"]
    rep = build_report(settings, result, timings={}, out=str(path))
    rep["offline"] = True
    emit(rep, None, type("O", (), {"json_out": json_out, "quiet": quiet, "html": html, "markdown": markdown})())
    return rep["exit_code"]
