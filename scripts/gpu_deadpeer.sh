#!/usr/bin/env bash
# Dead and hung peers over NCCL through both launchers, side by side (docs/gpu-results.md):
#   OUT=dir bash scripts/gpu_deadpeer.sh
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=${STACKS:-30}
OUT=${OUT:-.}
run() {  # name, launcher, args...
  local name=$1 how=$2; shift 2
  local t0=$(date +%s)
  if [ "$how" = torchrun ]; then
    timeout -k 2 75 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m tpprobe probe --out /tmp/dp/$name --quiet --backend nccl "$@" > /tmp/dp/$name.log 2>&1
  else
    timeout -k 2 75 python3 -m tpprobe probe --nproc 2 --out /tmp/dp/$name --quiet --backend nccl "$@" > /tmp/dp/$name.log 2>&1
  fi
  echo "rc=$? wall=$(( $(date +%s) - t0 ))" >> /tmp/dp/$name.log
}
rm -rf /tmp/dp; mkdir -p /tmp/dp
run kill-probe probe --inject kill-rank@1 --timeout 15 &
run hang-probe probe --inject hang-rank@1 --timeout 10 &
run kill-torchrun torchrun --inject kill-rank@1 --timeout 15 &
run hang-torchrun torchrun --inject hang-rank@1 --timeout 10 &
run extra-torchrun torchrun --inject extra-collective@1 --timeout 20 &
run fp-bf16-17tok probe --dtype bfloat16 --exchange fingerprint --tokens 17 --hidden 7168 --heads 56 --ffn 14336 &
wait
python3 - "$OUT/deadpeer.json" <<'PY'
import json, pathlib, sys
out = {}
for log in sorted(pathlib.Path("/tmp/dp").glob("*.log")):
    name = log.stem
    rep = pathlib.Path("/tmp/dp", name, "report.json")
    r = json.loads(rep.read_text()) if rep.is_file() else None
    out[name] = {"log_tail": log.read_text()[-6000:],
                 "total_s": r and r["timings"].get("total_s"), "ranks_missing": r and r.get("ranks_missing"),
                 "findings": r and [(f["severity"], f["kind"], f["where"], f["ranks"], f["line"]) for f in r["findings"]],
                 "flight_recorder": r and r.get("flight_recorder"), "exchange": r and r.get("exchange")}
json.dump(out, open(sys.argv[1], "w"), indent=1)
for k, v in out.items():
    print(k, v["total_s"], v["ranks_missing"], [(f[1], f[3]) for f in (v["findings"] or []) if f[0] == "failure"], v["log_tail"].splitlines()[-1])
PY
