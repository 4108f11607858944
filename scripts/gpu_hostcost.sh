#!/usr/bin/env bash
# One call on ONE H200 for the probe's host cost in eager decode (issue 14, point 3), on the tree
# with the new Tap (hooks only where they do work, a wrapper where a module has none, collectives
# placed from the running module calls) and the fingerprint combine on the device:
#  1. the GPU tier (fingerprints, device combine == host combine, tp-1 graph taps) and the probes
#     (world-1 NCCL; gloo ranks with CUDA tensors at tp 2) side by side;
#  2. alone on the GPU: bench/fp_small.py (a fingerprint's add / kernel / combine, device vs host
#     combine in one run), bench/tap_phases.py, and bench/nccl_overhead.py --before (the overhead
#     side by side with the Tap this tree replaced), also with --collectives (every row-parallel
#     output all-reduced over the world-1 NCCL group, as a tp-2 model issues them);
#  3. whether NCCL takes two ranks on one GPU.
#   OUT=dir bash scripts/gpu_hostcost.sh     -> $OUT/hostcost.tgz
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=/tmp/hc; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
run pytest-gpu 240 $PY -m pytest -m gpu -p no:cacheprovider -n 3 -q -rA --basetemp=$W/pt \
    tests/test_fingerprint.py tests/test_graph_tap.py tests/test_hooks.py $ONE_GPU_DESELECT &
( run nccl-two-ranks-one-gpu 60 $PY scripts/nccl_one_gpu.py
  run probe-nccl1-fp 90 $PY -m tpprobe probe --backend nccl --nproc 1 --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-nccl1-fp
  TPPROBE_GLOO_CUDA=1 run gc-healthy-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --out $W/gc-healthy-fp
  TPPROBE_GLOO_CUDA=1 run gc-skip-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --inject skip-allreduce@2 --out $W/gc-skip-fp
  TPPROBE_GLOO_CUDA=1 run gc-extra 90 $PY -m tpprobe probe --backend gloo --nproc 2 --inject extra-collective@1 --timeout 15 --out $W/gc-extra
) &
wait
tail -3 $W/nccl-two-ranks-one-gpu.log
run fp-small-1 60 $PY bench/fp_small.py --rows 1
run fp-small-64 60 $PY bench/fp_small.py --rows 64
run fp-small-8192 90 $PY bench/fp_small.py --rows 8192 --n 3 --iters 30
run tap-phases-1 120 $PY bench/tap_phases.py --tokens 1 --rounds 80 --out $W/t1
run nccl-overhead-tp1 300 $PY bench/nccl_overhead.py --nproc 1 --before --iters 5 --out $W/ov
run nccl-overhead-tp1-coll 300 $PY bench/nccl_overhead.py --nproc 1 --collectives --before --profile --iters 5 --out $W/ovc
cat $W/fp-small-1.log $W/fp-small-64.log $W/fp-small-8192.log
tail -8 $W/tap-phases-1.log; tail -6 $W/nccl-overhead-tp1.log; tail -6 $W/nccl-overhead-tp1-coll.log
find $W -name "*.safetensors" -delete; rm -rf $W/pt
tar -czf $OUT/hostcost.tgz -C /tmp hc
