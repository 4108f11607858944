#!/usr/bin/env bash
# One call on ONE H200 at the submitted tree (issue 14, point 3), after ProcessGroup's doors
# (capture/audit.py `_door`) and the leaner fingerprint read:
#  1. the GPU tier (fingerprints, device combine, tp-1 graph taps, the audit on NCCL: door and
#     kernel) and probes side by side: world-1 NCCL fingerprint; gloo ranks with CUDA tensors at
#     tp 2 (the doors with two real ranks), healthy and a skipped all-reduce;
#  2. alone on the GPU: bench/nccl_overhead.py --kernel (doors vs the dispatcher kernel side by
#     side, probe off with nothing of the audit registered), without and with --collectives;
#     bench/collective_split.py; bench/tap_phases.py --collectives.
#   OUT=dir bash scripts/gpu_doors_final.sh     -> $OUT/doors_final.tgz
source scripts/gpu_lib.sh
setup /tmp/df
run pytest-gpu 300 $PY -m pytest -m gpu -p no:cacheprovider -n 3 -q -rA --basetemp=$W/pt \
    tests/test_fingerprint.py tests/test_graph_tap.py tests/test_hooks.py $ONE_GPU_DESELECT &
( run probe-nccl1-fp 90 $PY -m tpprobe probe --backend nccl --nproc 1 --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-nccl1-fp
  TPPROBE_GLOO_CUDA=1 run gc-healthy-fp 120 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --out $W/gc-healthy-fp
  TPPROBE_GLOO_CUDA=1 run gc-skip-fp 120 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --inject skip-allreduce@2 --out $W/gc-skip-fp
  TPPROBE_GLOO_CUDA=1 run gc-skip-full 120 $PY -m tpprobe probe --backend gloo --nproc 2 --inject skip-allreduce@2 --out $W/gc-skip-full
) &
wait
grep -E "passed|failed" $W/pytest-gpu.log | tail -3
run nccl-overhead-tp1 300 $PY bench/nccl_overhead.py --nproc 1 --kernel --iters 5 --out $W/ov
run nccl-overhead-tp1-coll 300 $PY bench/nccl_overhead.py --nproc 1 --collectives --kernel --iters 5 --out $W/ovc
run split-1 120 $PY bench/collective_split.py --tokens 1 --rounds 300
run phases-coll-1 120 $PY bench/tap_phases.py --tokens 1 --rounds 60 --collectives --out $W/phc
tail -6 $W/nccl-overhead-tp1.log; tail -6 $W/nccl-overhead-tp1-coll.log; tail -13 $W/split-1.log; tail -9 $W/phases-coll-1.log
find $W -name "*.safetensors" -delete; rm -rf $W/pt
tar -czf $OUT/doors_final.tgz -C /tmp df
