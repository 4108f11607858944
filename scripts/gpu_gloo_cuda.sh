#!/usr/bin/env bash
# Diagnostic on ONE GPU: gloo ranks with CUDA tensors (TPPROBE_GLOO_CUDA=1, both ranks on the same
# GPU), so the CUDA code paths run at tp 2 where NCCL needs two GPUs. Not an NCCL result.
#   OUT=dir bash scripts/gpu_gloo_cuda.sh      -> $OUT/gloo_cuda.tgz (logs + report.json files)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_GLOO_CUDA=1
OUT=${OUT:-.}; W=/tmp/gc; rm -rf $W; mkdir -p $W
source scripts/gpu_lib.sh
P="python3 -m tpprobe probe --backend gloo --nproc 2"
I="python3 -m tpprobe invariance --backend gloo --debug"
run probe-healthy 90 $P --out $W/probe-healthy &
run probe-fp-bf16 90 $P --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-fp-bf16 &
run probe-skip 90 $P --inject skip-allreduce@2 --out $W/probe-skip &
wait
run probe-fp-skip 90 $P --dtype bfloat16 --exchange fingerprint --inject skip-allreduce@2 --out $W/probe-fp-skip &
run probe-extra 90 $P --inject extra-collective@1 --timeout 15 --out $W/probe-extra &
run inv-default 150 $I --tp 1,2 --batch 1,3,8 --out $W/inv-default &
wait
run inv-ordered 150 $I --tp 1,2 --batch 1,3,8 --reduce ordered --out $W/inv-ordered &
run inv-bf16 150 $I --tp 1,2 --batch 1,3 --dtype bfloat16 --out $W/inv-bf16 &
wait
tar -czf $OUT/gloo_cuda.tgz -C /tmp gc
