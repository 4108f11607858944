#!/usr/bin/env bash
# The GPU runner: named suites for the lent GPU machine (torch, triton, no SGLang, no package index).
#
#   PYTHONPATH=. NCCL_NVLS_ENABLE=0 bash scripts/gpu.sh tier        # the GPU test tier
#   bash scripts/gpu.sh [--out DIR] [--dry-run] SUITE...              # SUITE: tier probes bench accept all
#   bash scripts/gpu.sh --list                                        # every suite's steps, nothing run
#
#   tier    python -m pytest -m gpu tests/ (junit tier.xml, log tier.log); the cases that need 2 GPUs
#           skip by themselves on one (tests/conftest.py: needs_gpus)
#   probes  tpprobe probe / invariance on the GPU: world-1 NCCL, gloo ranks holding CUDA tensors
#           (TPPROBE_GLOO_CUDA=1) at tp 2; with 2 GPUs, NCCL at tp 2 through both launchers,
#           a dead / hung / extra-collective rank; each step checks the exit code it expects
#   bench   the GPU numbers of docs/benchmarks.md, one bench at a time (alone on the GPU)
#   accept  bench/accept_device.sh: `tpprobe accept` on cuda against cpu (docs/accept.md)
#   all     the four in that order (longer than one 10-minute device call: run one suite a call)
#
# Output: --out DIR, else $OUT, else a fresh `mktemp -d`; each suite writes into DIR/SUITE/, each
# step's output into NAME.log, ending in "rc=N wall=S". Nothing else on the machine is written.
# Exit status: 0 when every step gave the exit code it expects, 1 otherwise. GPUS=N overrides the
# GPU count (what --list and --dry-run show for a 2-GPU machine: GPUS=2 ... --list).
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.." || exit 2

export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
DRY=0 LIST=0 OUTDIR=${OUT:-} SUITES=()
while (($#)); do
  case $1 in
    --out) OUTDIR=$2; shift 2 ;;
    --out=*) OUTDIR=${1#--out=}; shift ;;
    --dry-run) DRY=1; shift ;;
    --list) LIST=1 DRY=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    tier|probes|bench|accept) SUITES+=("$1"); shift ;;
    all) SUITES+=(tier probes bench accept); shift ;;
    *) echo "gpu.sh: unknown suite or option '$1' (suites: tier probes bench accept all)" >&2; exit 2 ;;
  esac
done
((LIST)) && ((${#SUITES[@]} == 0)) && SUITES=(tier probes bench accept)
((${#SUITES[@]})) || { echo "gpu.sh: name a suite: tier probes bench accept all (--list shows their steps)" >&2; exit 2; }
[[ -n $OUTDIR && $OUTDIR != /* ]] && OUTDIR=$CALLER/$OUTDIR     # relative to where it was called
if ((DRY)); then OUTDIR=${OUTDIR:-OUTDIR}; else OUTDIR=${OUTDIR:-$(mktemp -d)}; mkdir -p "$OUTDIR"; fi
NGPU=${GPUS:-$( ((DRY)) && echo 1 || $PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
FAILED=0

# run NAME LIMIT_S EXPECTED_RC COMMAND...: the command under `timeout`, its output in $D/NAME.log
# (ending "rc=N wall=S"); prints that line and the verdict lines; counts a step whose rc differs
run() {
  local name=$1 lim=$2 want=$3; shift 3
  if ((DRY)); then echo "  $name (limit ${lim}s, expects rc $want): $*"; return; fi
  local s; s=$(date +%s.%N)
  timeout -k 5 "$lim" "$@" > "$D/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc wall=$($PY -c "print(round($(date +%s.%N)-$s,1))")" >> "$D/$name.log"
  local mark=ok; [[ $rc == "$want" ]] || { mark="FAILED (expected rc $want)"; FAILED=1; }
  echo "== $name: $(tail -1 "$D/$name.log") $mark"
  if [[ $mark == ok ]]; then
    grep -E "^  (HEALTHY|FAILURE|BITWISE|NOT BITWISE|WARNING)|tpprobe: error|Fatal| passed| failed|error" \
      "$D/$name.log" | tail -3
  else
    tail -15 "$D/$name.log"          # what went wrong, in the device call's own output
  fi
}

machine() {
  if ((DRY)); then echo "  machine: nvidia-smi and the versions of torch, CUDA, NCCL, triton -> machine.log"; return; fi
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -4
    $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
'.'.join(map(str, torch.cuda.nccl.version())), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  } > "$D/machine.log" 2>&1
  cat "$D/machine.log"
}

suite_tier() {
  machine
  # pytest-xdist when it is there: 3 workers share one GPU (the tier's cases are small); with more
  # GPUs one worker, as the NCCL cases each hold every GPU
  local jobs=()
  if ((!DRY)) && ((NGPU == 1)) && $PY -c "import xdist" 2>/dev/null; then jobs=(-n "${JOBS:-3}"); fi
  # --continue-on-collection-errors: a test file that cannot import here (a missing test
  # dependency) is reported as an error, and the rest of the tier still runs
  run tier 560 0 $PY -m pytest -m gpu -p no:cacheprovider -q -rA "${jobs[@]}" --continue-on-collection-errors \
      --junitxml="$D/tier.xml" --basetemp="$D/pytest-tmp" tests/
  ((DRY)) || rm -rf "$D/pytest-tmp"
}

suite_probes() {
  machine
  local P=($PY -m tpprobe probe)
  run nccl1 120 0 "${P[@]}" --backend nccl --nproc 1 --out "$D/nccl1"
  run nccl1-fp-bf16 120 0 "${P[@]}" --backend nccl --nproc 1 --dtype bfloat16 --exchange fingerprint --tokens 37 \
      --out "$D/nccl1-fp-bf16"
  run nccl1-nan 120 1 "${P[@]}" --backend nccl --nproc 1 --inject nan@0 --out "$D/nccl1-nan"
  run gc-fp 150 0 env TPPROBE_GLOO_CUDA=1 "${P[@]}" --backend gloo --nproc 2 --dtype bfloat16 \
      --exchange fingerprint --out "$D/gc-fp"
  run gc-skip-fp 150 1 env TPPROBE_GLOO_CUDA=1 "${P[@]}" --backend gloo --nproc 2 --dtype bfloat16 \
      --exchange fingerprint --inject skip-allreduce@2 --out "$D/gc-skip-fp"
  run gc-skip-full 150 1 env TPPROBE_GLOO_CUDA=1 "${P[@]}" --backend gloo --nproc 2 \
      --inject skip-allreduce@2 --out "$D/gc-skip-full"
  # on a GPU a prompt's rows depend on the batch inside layer 0 (cuBLAS picks its GEMM by shape):
  # not bitwise (exit 1); per-row matmuls (--reduce ordered) are
  run inv-tp1 200 1 $PY -m tpprobe invariance --backend nccl --tp 1 --batch 1,3,8 --out "$D/inv-tp1"
  run inv-tp1-ordered 200 0 $PY -m tpprobe invariance --backend nccl --tp 1 --batch 1,3,8 --reduce ordered \
      --out "$D/inv-tp1-ordered"
  if ((NGPU >= 2)); then
    local T=($PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tpprobe probe)
    run nccl2 150 0 "${P[@]}" --backend nccl --nproc 2 --out "$D/nccl2"
    run nccl2-torchrun 150 0 "${T[@]}" --backend nccl --out "$D/nccl2-torchrun"
    run nccl2-skip 150 1 "${P[@]}" --backend nccl --nproc 2 --inject skip-allreduce@2 --out "$D/nccl2-skip"
    run nccl2-kill 150 1 "${P[@]}" --backend nccl --nproc 2 --inject kill-rank@1 --timeout 15 --out "$D/nccl2-kill"
    run nccl2-hang 150 1 "${P[@]}" --backend nccl --nproc 2 --inject hang-rank@1 --timeout 10 --out "$D/nccl2-hang"
    run nccl2-extra 150 1 "${P[@]}" --backend nccl --nproc 2 --inject extra-collective@1 --timeout 20 \
        --out "$D/nccl2-extra"
    run inv-tp12 300 1 $PY -m tpprobe invariance --backend nccl --tp 1,2 --batch 1,3,8 --out "$D/inv-tp12"
  fi
  ((DRY)) || find "$D" -name "*.safetensors" -delete
}

suite_bench() {
  machine
  run hook-overhead 300 0 $PY bench/hook_overhead.py --device cuda --dtype bfloat16 --hidden 7168 --tokens 8192 \
      --num-layers 4 --heads 56 --ffn 18432 --vocab 4096 --iters 10 --warmup 2 --out "$D"
  run fingerprint-gpu 300 0 $PY bench/fingerprint_gpu.py --ablate --iters 50 --out "$D"
  run nccl-overhead-tp1 400 0 $PY bench/nccl_overhead.py --nproc 1 --kernel --iters 5 --out "$D/nccl-overhead-tp1"
  run nccl-overhead-tp1-coll 400 0 $PY bench/nccl_overhead.py --nproc 1 --collectives --kernel --iters 5 \
      --out "$D/nccl-overhead-tp1-coll"
  run graph-decode-tp1 300 0 $PY bench/graph_decode.py --tp 1 --rounds 12 --iters 40 --out "$D/graph_decode_tp1.json"
  run watch-builtin 200 0 $PY bench/watch_builtin.py --iters 5 --decode-iters 20 --out "$D/watch_builtin.json"
  run collective-split 150 0 $PY bench/collective_split.py --tokens 1 --rounds 300
  run tap-phases-coll 150 0 $PY bench/tap_phases.py --tokens 1 --rounds 60 --collectives --out "$D/tap-phases-coll"
  run launch-path 150 0 $PY bench/launch_path.py --rows 1
  run fp-small 150 0 $PY bench/fp_small.py --rows 1
  if ((NGPU >= 2)); then
    run nccl-overhead-tp2 500 0 $PY bench/nccl_overhead.py --nproc 2 --out "$D/nccl-overhead-tp2"
    run graph-decode-tp2 300 0 $PY bench/graph_decode.py --tp 2 --rounds 12 --iters 40 --out "$D/graph_decode_tp2.json"
  fi
}

suite_accept() {
  run accept 560 0 env OUT="$D" bash bench/accept_device.sh
}

echo "gpu.sh: ${SUITES[*]} on $NGPU GPU(s), output in $OUTDIR"
for s in "${SUITES[@]}"; do
  D=$OUTDIR/$s
  ((DRY)) || mkdir -p "$D"
  echo "== suite $s -> $D"
  "suite_$s"
done
((DRY)) || echo "gpu.sh: done, $( ((FAILED)) && echo "some steps FAILED" || echo "every step as expected"); output in $OUTDIR"
exit $FAILED
