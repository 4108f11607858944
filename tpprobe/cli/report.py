"""`tpprobe report DIR`: the same checks as the live probe, on the files, with no process running."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..checks.findings import FAILURE
from ..checks.offline import check_run, run_settings
from ..engines.fault_fired import KEY, unfired_line
from ..engines.registry import recorded
from ..formats.capture_dir import load_run
from ..report.model import build_report
from ..probe.report import probe_report
from ..report.emit import Flags, emit


def report_dir(path: Path, json_out: bool = False, html: Optional[str] = None, markdown: Optional[str] = None,
               quiet: bool = False) -> int:
    from ..formats.capture_dir import check_file_path
    for flag, out in (("--html", html), ("--markdown", markdown)):
        if out:
            check_file_path(Path(out), flag)
    path = Path(path)
    if path.is_dir() and not (path / "manifest.json").exists():
        from .steps import find_steps, report_steps
        if find_steps(path):      # a plugin's run (SGLang's, vLLM's): many steps, maybe many TP groups
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
    if (path / "drafter").is_dir():
        from .drafter import add_drafter
        add_drafter(path, rep)      # the step's EAGLE-3 drafter input, judged as in the run's report
    emit(probe_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown, quiet=quiet))
    return rep["exit_code"]


def damaged_files(rep: dict) -> list[str]:
    """`rank-001.safetensors (rank 1): missing` for each file of the folder that is missing, truncated or
    unreadable (an extra file is a warning, not damage)."""
    return [f"{f['where']}" + (f" (rank {f['ranks'][0]})" if f["ranks"] and f"rank {f['ranks'][0]}" != f["where"]
                               else "") + f": {f['detail']}"
            for f in rep["findings"] if f["kind"] == "capture-file" and f["severity"] == FAILURE]


def check_dir(path: Path, manifest: Optional[dict] = None) -> dict:
    """The report of one capture folder (one forward of one TP group), not printed. `manifest`: its manifest, when
    the caller read it already (tpprobe.formats.capture_dir.read_manifest's)."""
    run = load_run(path, manifest=manifest)
    settings, result = check_run(run, offset_rule=recorded(run_settings(run)).offset_rule)
    line = unfired_line(settings.get("inject") or [], run.manifest["world_size"],
                        {r: (x.meta.status, x.meta.extra.get(KEY)) for r, x in run.records.items()})
    if line is not None:        # the probe that wrote it gave no verdict: neither does its report
        from ..core.errors import UsageError
        raise UsageError(f"{path}: {line}")
    rep = build_report(settings, result, timings=dict(run.manifest.get("timings") or {}), out=str(path))
    rep["offline"] = True
    return rep
