"""The fault table of docs/faults.md, from real runs: `python scripts/fault_table.py [--write]`.

Runs `tpprobe probe --inject FAULT` for every fault of the catalogue on the built-in model (CPU,
gloo) and prints one Markdown row per fault with the verdict line tpprobe printed; `--write`
puts the table into docs/faults.md. tests/ranks/test_faults.py builds the same table from the runs it makes
anyway (this module's `table`) and fails when the page's differs, so the table cannot drift.

What depends on timing is not in the table: a dead or hung rank's last heartbeat (which layer,
how many seconds before the others gave up) is shown as "…".
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "faults.md"
HEADER = "| catalogue | `--inject` | exit | verdict (first line of the report) |"

RUNS = [  # (inject, extra args)
    ("skip-embed-allreduce", []), ("skip-allreduce@2", []), ("subgroup-allreduce@1", ["--nproc", "4"]),
    ("rank-noise@1", []), ("rank-weight@1", []), ("slice-capture", []), ("capture-offset", []),
    ("drop-embed-slot", []), ("slot-order", []), ("alias-capture", []), ("nan@1", []),
    ("capture-dtype@1", ["--dtype", "bfloat16"]), ("capture-noncontig", []),
    ("extra-collective@1", ["--timeout", "20"]), ("embed-after-norm", []),
    ("kill-rank@1", ["--timeout", "15"]), ("hang-rank@1", ["--timeout", "10"]), ("drop-last-id", []),
]


def key(inject: str, extra) -> tuple:
    """One run, however its arguments are spelled: (inject, nproc, the other arguments); the
    defaults (--nproc 2, --dtype float32) left out."""
    extra, nproc, rest = list(extra), 2, []
    while extra:
        a = extra.pop(0)
        v = extra.pop(0) if a in ("--nproc", "--dtype", "--timeout") and extra else None
        if a == "--nproc":
            nproc = int(v)
        elif (a, v) != ("--dtype", "float32"):
            rest += [a] + ([v] if v is not None else [])
    return inject, nproc, tuple(rest)


def run(inject: str, extra, out: Path) -> tuple[int, dict]:
    """(exit code, report.json) of one `tpprobe probe --inject` run."""
    args = [sys.executable, "-m", "tpprobe", "probe", "--inject", inject, "--out", str(out), "--quiet", *extra]
    rc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT).returncode
    rep_path = Path(out) / "report.json"
    return rc, json.loads(rep_path.read_text()) if rep_path.exists() else {}


def stable_line(report: dict) -> str:
    """The report's first line, without what depends on timing (a missing rank's last heartbeat)."""
    if not report:
        return "(no report.json: the run failed before its report)"
    if not report.get("findings"):
        return "HEALTHY"
    f = report["findings"][0]
    line = f["line"]
    if f["kind"] == "rank-timeout":
        line = re.sub(r"(its last heartbeat said: [a-z]+)[^;]*", r"\1: …", line)
    return line


def fault_id(inject: str) -> str:
    from tpprobe.config.fault_names import FAULTS
    return FAULTS[inject.split("@")[0]][0]


def row(inject: str, extra, rc: int, report: dict) -> str:
    return (f"| {fault_id(inject)} | `{inject}`{' ' + ' '.join(extra) if extra else ''} | {rc} | "
            f"{stable_line(report).replace('|', '/')} |")


def table(results: dict) -> str:
    """The table from {key(inject, extra): (exit code, report)} holding every run of RUNS."""
    rows = [row(inject, extra, *results[key(inject, extra)]) for inject, extra in RUNS]
    return "\n".join([HEADER, "|---|---|---|---|", *rows])


def page_table(text: str) -> str:
    """The fault table as the page has it (the header, then every row up to the blank line)."""
    i = text.index(HEADER)
    j = text.find("\n\n", i)
    return text[i:j if j >= 0 else len(text)].strip()


def main() -> None:
    results = {}
    for inject, extra in RUNS:
        with tempfile.TemporaryDirectory() as d:
            results[key(inject, extra)] = run(inject, extra, Path(d) / "run")
        print(row(inject, extra, *results[key(inject, extra)]), file=sys.stderr, flush=True)
    t = table(results)
    if "--write" in sys.argv:
        text = PAGE.read_text()
        PAGE.write_text(text.replace(page_table(text), t))
    print(t)


if __name__ == "__main__":
    main()
