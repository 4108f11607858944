#!/usr/bin/env bash
# The NCCL run of docs/gpu-results.md on a 2-GPU machine (issue 14): machine header, the GPU test
# tier (catalogue, robustness, kill / hang / extra-collective through `tpprobe probe --nproc 2` and
# torchrun, fingerprint parity at every shape), the verdicts collected, and the overhead benchmark.
#   OUT=/some/dir bash scripts/gpu_nccl_run.sh [bench|tests|all]
set -uo pipefail
OUT=${OUT:-.}
what=${1:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
{
  date -u; nvidia-smi; nvidia-smi topo -m
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  $PY -c "from tpprobe.envinfo import environment, env_lines; import os; os.environ['LOCAL_WORLD_SIZE']='2'; [print(l) for l in env_lines(environment())]"
} > "$OUT/machine.txt" 2>&1
if [ "$what" != tests ]; then
  timeout 300 $PY bench/nccl_overhead.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -8
fi
if [ "$what" != bench ]; then
  rm -rf /tmp/pt && mkdir -p /tmp/pt
  # two pytest processes side by side (the GPUs are shared; every timing asserted is a rank's own)
  (timeout ${TESTS_S:-420} $PY -m pytest -m gpu -p no:cacheprovider -q -rs --basetemp=/tmp/pt/a \
     tests/test_fingerprint.py tests/test_robustness.py > "$OUT/pytest-a.log" 2>&1) &
  (timeout ${TESTS_S:-420} $PY -m pytest -m gpu -p no:cacheprovider -q -rs --basetemp=/tmp/pt/b -n ${NJOBS:-3} \
     tests/test_faults.py ${EXTRA_TESTS:-} > "$OUT/pytest-b.log" 2>&1) &
  wait
  tail -25 "$OUT/pytest-a.log" "$OUT/pytest-b.log"
  $PY - "$OUT/verdicts.json" <<'PY'
import json, pathlib, sys
rows = []
for p in sorted(pathlib.Path("/tmp/pt").rglob("report.json")):
    r = json.loads(p.read_text())
    s = r.get("settings", {})
    rows.append({"dir": str(p.parent).replace("/tmp/pt/", ""), "backend": s.get("backend"),
                 "world": s.get("world_size"), "inject": s.get("inject"), "exchange": s.get("exchange"),
                 "total_s": r.get("timings", {}).get("total_s"), "ranks_missing": r.get("ranks_missing"),
                 "findings": [{k: f.get(k) for k in ("severity", "kind", "where", "ranks", "line")}
                              for f in r.get("findings", [])],
                 "flight_recorder": r.get("flight_recorder"), "env": r.get("environment", {}).get("topology")})
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(len(rows), "reports")
PY
fi
