#!/usr/bin/env bash
# One call on ONE H200: the tree after the host-cost work (audit kernels, fingerprint Batch):
# the GPU tier for one GPU and the probes side by side, then the benchmarks alone on the GPU.
#   OUT=dir bash scripts/gpu_final.sh     -> $OUT/final.tgz (logs, JSON, profiles)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-.}; W=/tmp/fin; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
run pytest-gpu 200 $PY -m pytest -m gpu -p no:cacheprovider -n 3 -q -rA --basetemp=$W/pt \
    tests/test_fingerprint.py tests/test_graph_tap.py $ONE_GPU_DESELECT &
( run probe-nccl1 90 $PY -m tpprobe probe --backend nccl --nproc 1 --out $W/probe-nccl1
  run probe-nccl1-fp 90 $PY -m tpprobe probe --backend nccl --nproc 1 --dtype bfloat16 --exchange fingerprint --tokens 37 --out $W/probe-nccl1-fp
  TPPROBE_GLOO_CUDA=1 run gc-healthy-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --out $W/gc-healthy-fp
  TPPROBE_GLOO_CUDA=1 run gc-skip-fp 90 $PY -m tpprobe probe --backend gloo --nproc 2 --dtype bfloat16 --exchange fingerprint --inject skip-allreduce@2 --out $W/gc-skip-fp
  TPPROBE_GLOO_CUDA=1 run gc-extra 90 $PY -m tpprobe probe --backend gloo --nproc 2 --inject extra-collective@1 --timeout 15 --out $W/gc-extra
) &
wait
run fingerprint-host 120 $PY bench/fingerprint_host.py --out $W
run nccl-overhead-tp1 200 $PY bench/nccl_overhead.py --nproc 1 --profile --out $W
run graph-decode-tp1 150 $PY bench/graph_decode.py --tp 1 --rounds 8 --iters 30 --out $W/graph_decode_tp1.json
tail -8 $W/nccl-overhead-tp1.log; tail -6 $W/graph-decode-tp1.log; tail -15 $W/fingerprint-host.log
find $W -name "*.safetensors" -delete; rm -rf $W/pt
tar -czf $OUT/final.tgz -C /tmp fin
