#!/usr/bin/env bash
# One call on ONE H200: the Tap's host cost in eager decode after its hooks are written straight
# into the modules' hook dicts (bench/nccl_overhead.py --api times the torch-API registration side
# by side), a cProfile of it, and whether NCCL takes two ranks on one GPU here (it refuses on
# NCCL >= 2.x: "Duplicate GPU detected"; recorded, so the 2-GPU work is known to need 2 GPUs).
#   OUT=dir bash scripts/gpu_hostcost.sh     -> $OUT/hostcost.tgz
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=/tmp/hc; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
run nccl-two-ranks-one-gpu 60 $PY scripts/nccl_one_gpu.py
tail -4 $W/nccl-two-ranks-one-gpu.log
run nccl-overhead-tp1 300 $PY bench/nccl_overhead.py --nproc 1 --api --profile --iters 5 --out $W
tail -6 $W/nccl-overhead-tp1.log
tar -czf $OUT/hostcost.tgz -C /tmp hc
