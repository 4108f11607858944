#!/usr/bin/env bash
# Run the tpprobe probe under torchrun; every setting can be overridden from the environment.
#
#   bash launch/torchrun.sh                                   # 2 local ranks, built-in model
#   NPROC=8 bash launch/torchrun.sh --layers -1,2,30 --num-layers 61 --hidden 7168 --dtype bfloat16
#   NPROC=4 bash launch/torchrun.sh --inject skip-allreduce@2 # see what a broken reduce looks like
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=node0:29400 NPROC=8 bash launch/torchrun.sh   # on each node
#
# The ranks use NCCL when every rank has a CUDA device and gloo otherwise (--backend overrides).
# Keep NCCL_NVLS_ENABLE=0 on hosts where NVLink multicast is not set up.
set -euo pipefail
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
RDZV_ID=${RDZV_ID:-tpprobe-$$}
LOG_RANKS=${LOG_RANKS:-0}          # whose output to show (--local-ranks-filter)
PYTHON=${PYTHON:-python}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

# `tpprobe torchrun` is torchrun with every option, ending like tpprobe (exit 1 on findings, no
# ChildFailedError traceback)
exec "$PYTHON" -m tpprobe torchrun \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
  --local-ranks-filter "$LOG_RANKS" --tee 3 \
  probe "$@"
