"""The report model: one dict (report.json) that every renderer draws from.

`build_report` assembles it from the checks' result; `write_json` is the JSON sink. Renderers
(terminal, html, markdown) read this dict and share their words through `labels`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .. import __version__
from ..checks.findings import exit_code

SCHEMA = "tpprobe.report/1"


def environment() -> dict:
    from .envinfo import environment as _environment
    return _environment()


def build_report(settings: dict, result: dict, timings: dict, out: Optional[str]) -> dict:
    findings = result["findings"]
    return {"schema": SCHEMA, "tool": f"tpprobe {__version__}", "settings": settings,
            "environment": environment(), "timings": timings, "out": out,
            "points": result["points"], "allreduce": result["allreduce"], "slots": result["slots"],
            "coverage": result.get("coverage", {}),
            "ranks_missing": result.get("ranks_missing", []), "findings": findings,
            "exit_code": exit_code(findings)}


def write_json(report: dict, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes
    atomic_write_bytes(Path(path), json.dumps(report, indent=1, default=str).encode())
