"""Regenerate the README's fault table from real runs: `python scripts/fault_table.py > docs/faults.md`.

Runs `tpprobe probe --inject FAULT` for every fault of the catalogue on the built-in model (CPU,
gloo) and prints one Markdown row per fault with the verdict line tpprobe printed.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tpprobe.faults import FAULTS

RUNS = [  # (inject, extra args)
    ("skip-embed-allreduce", []), ("skip-allreduce@2", []), ("subgroup-allreduce@1", ["--nproc", "4"]),
    ("rank-noise@1", []), ("rank-weight@1", []), ("slice-capture", []), ("capture-offset", []),
    ("drop-embed-slot", []), ("slot-order", []), ("alias-capture", []), ("nan@1", []),
    ("capture-dtype@1", ["--dtype", "bfloat16"]), ("capture-noncontig", []),
    ("extra-collective@1", ["--timeout", "20"]), ("embed-after-norm", []),
    ("kill-rank@1", ["--timeout", "15"]), ("hang-rank@1", ["--timeout", "10"]), ("drop-last-id", []),
]


def main() -> None:
    print("| catalogue | `--inject` | exit | verdict (first line of the report) |")
    print("|---|---|---|---|")
    for inject, extra in RUNS:
        with tempfile.TemporaryDirectory() as d:
            args = [sys.executable, "-m", "tpprobe", "probe", "--inject", inject, "--out", d, "--quiet", *extra]
            rc = subprocess.run(args, capture_output=True, text=True).returncode
            rep = json.loads((Path(d) / "report.json").read_text())
        line = rep["findings"][0]["line"] if rep["findings"] else "HEALTHY"
        fid = FAULTS[inject.split("@")[0]][0]
        print(f"| {fid} | `{inject}`{' ' + ' '.join(extra) if extra else ''} | {rc} | {line.replace('|', '/')} |",
              flush=True)


if __name__ == "__main__":
    main()
