#!/usr/bin/env bash
# One call on ONE H200 (`nvidia-h200`): the merged tree on CUDA at tp 1 (NCCL world of one):
# the GPU test tier that needs one GPU, probe and invariance over NCCL with each rank's stderr kept,
# then the eager-decode overhead and the graph-decode overhead alone on the GPU.
#   OUT=dir bash scripts/gpu_tp1.sh        (STEPS="tests probe bench" by default)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=${STACKS:-60}
OUT=${OUT:-.}; W=$OUT/w; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
STEPS=${STEPS:-"tests probe bench"}
P="$PY -m tpprobe probe --backend nccl --nproc 1"
if [[ $STEPS == *tests* ]]; then
  run pytest-gpu ${PYTEST_S:-200} $PY -m pytest -m gpu -p no:cacheprovider -n 3 -v -rA --basetemp=$W/pt \
      tests/test_fingerprint.py tests/test_graph_tap.py ${EXTRA_TESTS:-} $ONE_GPU_DESELECT &
fi
if [[ $STEPS == *probe* ]]; then
  ( run probe-healthy 90 $P --out $W/probe-healthy
    run probe-fp-bf16 90 $P --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-fp-bf16
    run probe-nan 90 $P --inject nan@0 --out $W/probe-nan
    run inv-tp1 150 $PY -m tpprobe invariance --backend nccl --tp 1 --batch 1,3,8 --debug --out $W/inv-tp1
    run inv-tp1-bf16 150 $PY -m tpprobe invariance --backend nccl --tp 1 --batch 1,3,8 --dtype bfloat16 --hidden 7168 --heads 56 --ffn 14336 --num-layers 4 --debug --out $W/inv-tp1-bf16
    run inv-tp1-ordered 150 $PY -m tpprobe invariance --backend nccl --tp 1 --batch 1,3,8 --reduce ordered --debug --out $W/inv-tp1-ordered
  ) &
fi
wait
if [[ $STEPS == *bench* ]]; then
  run nccl-overhead-tp1 200 $PY bench/nccl_overhead.py --nproc 1 --profile --out $W
  run graph-decode-tp1 150 $PY bench/graph_decode.py --tp 1 --rounds 8 --iters 30 --out $W/graph_decode_tp1.json
fi
for f in $W/*.log; do echo "===== $f"; tail -${TAILN:-25} $f; done
