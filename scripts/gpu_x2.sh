#!/usr/bin/env bash
# One call on TWO GPUs (`nvidia-h200-x2`), the first for the merged tree over NCCL: the probe's
# healthy / dead / hung / extra-collective runs, invariance at tp 1,2 with the ranks' stderr, the
# eager overhead at tp 2, the GPU pytest tier of the NCCL cases.  OUT=dir bash scripts/gpu_x2.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=${STACKS:-40}
OUT=${OUT:-.}; W=/tmp/x2; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
P="$PY -m tpprobe probe --backend nccl --nproc 2"
I="$PY -m tpprobe invariance --backend nccl --debug"
run healthy 60 $P --out $W/healthy &
run healthy-fp 60 $P --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/healthy-fp &
wait
run kill 45 $P --inject kill-rank@1 --timeout 15 --out $W/kill &
run extra 60 $P --inject extra-collective@1 --timeout 20 --out $W/extra &
wait
run hang 40 $P --inject hang-rank@1 --timeout 10 --out $W/hang &
run inv 120 $I --tp 1,2 --batch 1,3,8 --out $W/inv &
wait
run inv-ordered 120 $I --tp 1,2 --batch 1,3,8 --reduce ordered --out $W/inv-ordered
run overhead-tp2 150 $PY bench/nccl_overhead.py --nproc 2 --prefill 8192 --iters 5 --decode-iters 20 --out $W
tail -7 $W/overhead-tp2.log
find $W -name "*.safetensors" -delete
tar -czf $OUT/x2.tgz -C /tmp x2
