#!/usr/bin/env bash
# One call on ONE H200 (diagnostic, issue 14 point 3): which part of the probe costs host time in
# an eager decode forward: bench/tap_split.py (audit, hooks, the slow call path of a hooked
# module, embedding discovery) and bench/fp_small.py (a fingerprint's add, kernel, read; a clone).
#   OUT=dir bash scripts/gpu_hostsplit.sh     -> $OUT/hostsplit.tgz
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=/tmp/hs; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
run tap-split-1 120 $PY bench/tap_split.py --tokens 1 --rounds 200
run tap-split-64 120 $PY bench/tap_split.py --tokens 64 --rounds 200
run fp-small-1 60 $PY bench/fp_small.py --rows 1
run fp-small-64 60 $PY bench/fp_small.py --rows 64
cat $W/tap-split-1.log $W/tap-split-64.log $W/fp-small-1.log $W/fp-small-64.log
tar -czf $OUT/hostsplit.tgz -C /tmp hs
