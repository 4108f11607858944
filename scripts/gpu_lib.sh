# Sourced by the scripts/gpu_*.sh device calls (needs $W, the folder logs go to).
# run NAME LIMIT_S COMMAND...: the command under `timeout`, its output in $W/NAME.log, which ends
# with "rc=N wall=S"; prints that line and the verdict lines.
run() {
  local name=$1 lim=$2; shift 2; local s=$(date +%s.%N)
  timeout -k 3 $lim "$@" > $W/$name.log 2>&1
  echo "rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$s,1))")" >> $W/$name.log
  echo "== $name: $(tail -1 $W/$name.log)"
  grep -E "^  (HEALTHY|FAILURE|BITWISE|NOT BITWISE|WARNING)|tpprobe: error|Fatal|passed|failed" $W/$name.log | tail -3
}
# machine: the GPUs, driver, torch, CUDA, NCCL and triton into $W/machine.log (and stdout)
machine() {
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } > $W/machine.log 2>&1
  cat $W/machine.log
}
# the GPU tier's cases that need two GPUs (tp-2 graph taps), left out of a one-GPU call's pytest
ONE_GPU_DESELECT="--deselect tests/test_graph_tap.py::test_graph_replay_fingerprints_equal_eager_at_every_point[2] --deselect tests/test_graph_tap.py::test_healthy_graph_replay_has_no_findings[2] --deselect tests/test_graph_tap.py::test_faults_in_the_graphed_model_are_named_exactly[2]"
# setup DIR: what every one-GPU call sets first (NCCL without NVLink multicast, unbuffered Python,
# this checkout importable, $OUT, a fresh work folder $W=DIR, $PY), then the machine's versions
setup() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  OUT=${OUT:-.}; W=$1; rm -rf $W; mkdir -p $W
  PY=python3
  machine
}
