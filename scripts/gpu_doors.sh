#!/usr/bin/env bash
# One call on ONE H200 (issue 14, point 3): where the host time of one audited collective goes,
# and what ProcessGroup's doors (capture/audit.py `_door`) save against the dispatcher kernel:
#  1. scripts/nccl_audit_check.py (door and kernel on NCCL) and the GPU tier of tests/test_hooks.py;
#  2. alone on the GPU: bench/collective_split.py (world-1 NCCL, per-collective host us by part),
#     bench/nccl_overhead.py --kernel (doors vs kernel side by side), with and without --collectives.
#   OUT=dir bash scripts/gpu_doors.sh     -> $OUT/doors.tgz
source scripts/gpu_lib.sh
setup /tmp/dr
run nccl-audit-check 120 $PY scripts/nccl_audit_check.py
cat $W/nccl-audit-check.log
run pytest-gpu-hooks 180 $PY -m pytest -m gpu -p no:cacheprovider -q -rA --basetemp=$W/pt tests/test_hooks.py
run split-1 120 $PY bench/collective_split.py --tokens 1 --rounds 300
run split-64 120 $PY bench/collective_split.py --tokens 64 --rounds 200
cat $W/split-1.log $W/split-64.log
run nccl-overhead-tp1 300 $PY bench/nccl_overhead.py --nproc 1 --kernel --iters 5 --out $W/ov
run nccl-overhead-tp1-coll 300 $PY bench/nccl_overhead.py --nproc 1 --collectives --kernel --iters 5 --out $W/ovc
tail -6 $W/nccl-overhead-tp1.log; tail -6 $W/nccl-overhead-tp1-coll.log
rm -rf $W/pt
tar -czf $OUT/doors.tgz -C /tmp dr
