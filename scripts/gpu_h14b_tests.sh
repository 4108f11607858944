#!/usr/bin/env bash
# The GPU pytest tier of the dead / hung / extra-collective cases over NCCL, both launchers (h14b):
#   OUT=dir bash scripts/gpu_h14b_tests.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=${STACKS:-40}
OUT=${OUT:-.}
s=$(date +%s)
timeout -k 3 ${TESTS_S:-140} python3 -m pytest -m gpu -p no:cacheprovider -n 5 -v -rA --basetemp=/tmp/hbt \
  --junitxml="$OUT/h14b-tests.xml" tests/test_faults.py tests/test_robustness.py \
  -k "kill or hung or hang or extra" > "$OUT/h14b-tests.log" 2>&1
echo "rc=$? wall=$(( $(date +%s) - s ))" >> "$OUT/h14b-tests.log"
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|rc=" "$OUT/h14b-tests.log" | tail -30
