#!/usr/bin/env bash
# The CPU benchmarks, in sequence (they share the cores: never run them side by side).
#   bench/run_all.sh [OUTDIR]        (default bench-out/)
# The GPU ones run on the lent H200 through `bash scripts/gpu.sh bench` (bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
$py bench/hook_overhead.py --hidden 4096 --tokens 256 --heads 32 --num-layers 4 --iters 7 --out "$out" | tee "$out/hook_overhead.txt"
$py bench/audit_overhead.py --out "$out" | tee "$out/audit_overhead.txt"
$py bench/check_cost.py --nprocs 2,4 --hidden 1024 --tokens 1024 --num-layers 5 --iters 3 --inject rank-noise@1 --out "$out" | tee "$out/check_cost.txt"
$py bench/offline_report.py --hidden 1024 --tokens 1024 --num-layers 6 --nproc 2 --iters 3 --out "$out" | tee "$out/offline_report.txt"
