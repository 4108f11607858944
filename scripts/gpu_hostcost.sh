#!/usr/bin/env bash
# One call on ONE H200 for the Tap's host cost in eager decode (issue 14, point 3): the GPU tier
# and the probes on the new Tap first (hooks only where they do work, collectives placed from the
# running module calls), then, alone on the GPU, where a decode forward's host time goes phase by
# phase (bench/tap_phases.py) and the overhead side by side with the Tap it replaced
# (bench/nccl_overhead.py --before), with a cProfile.  Also: does NCCL take two ranks on one GPU.
#   OUT=dir bash scripts/gpu_hostcost.sh     -> $OUT/hostcost.tgz
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=/tmp/hc; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
G1="--deselect tests/test_graph_tap.py::test_graph_replay_fingerprints_equal_eager_at_every_point[2] --deselect tests/test_graph_tap.py::test_healthy_graph_replay_has_no_findings[2] --deselect tests/test_graph_tap.py::test_faults_in_the_graphed_model_are_named_exactly[2]"
run pytest-gpu 200 $PY -m pytest -m gpu -p no:cacheprovider -n 3 -q -rA --basetemp=$W/pt \
    tests/test_fingerprint.py tests/test_graph_tap.py $G1 &
( run nccl-two-ranks-one-gpu 60 $PY scripts/nccl_one_gpu.py
  run probe-nccl1-fp 90 $PY -m tpprobe probe --backend nccl --nproc 1 --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-nccl1-fp
  TPPROBE_GLOO_CUDA=1 run gc-healthy-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --out $W/gc-healthy-fp
  TPPROBE_GLOO_CUDA=1 run gc-skip-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --inject skip-allreduce@2 --out $W/gc-skip-fp
) &
wait
tail -3 $W/nccl-two-ranks-one-gpu.log
run tap-phases-1 120 $PY bench/tap_phases.py --tokens 1 --rounds 80 --out $W/t1
run tap-phases-64 120 $PY bench/tap_phases.py --tokens 64 --rounds 80 --out $W/t64
run nccl-overhead-tp1 300 $PY bench/nccl_overhead.py --nproc 1 --before --profile --iters 5 --out $W
tail -8 $W/tap-phases-1.log; tail -8 $W/tap-phases-64.log; tail -6 $W/nccl-overhead-tp1.log
find $W -name "*.safetensors" -delete; rm -rf $W/pt
tar -czf $OUT/hostcost.tgz -C /tmp hc
