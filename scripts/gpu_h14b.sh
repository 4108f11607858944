#!/usr/bin/env bash
# One device call (issue 14, h14b): dead / hung peer over NCCL through `tpprobe probe --nproc 2`,
# torchrun healthy and with a dead peer, and the GPU fingerprint tests, side by side. Every command
# is under `timeout`; logs, reports and a summary land in $OUT.   OUT=dir bash scripts/gpu_h14b.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=${STACKS:-28}
OUT=${OUT:-.}; W=/tmp/hb; rm -rf $W; mkdir -p $W
PY=python3
source scripts/gpu_lib.sh
machine
P="$PY -m tpprobe probe --backend nccl --quiet"
TR="$PY -m torch.distributed.run --standalone --nproc-per-node 2 -m tpprobe probe --backend nccl --quiet"
if [ "${SET:-1}" = 1 ]; then
run kill-probe 45 $P --nproc 2 --inject kill-rank@1 --timeout 15 --out $W/kill-probe &
run hang-probe 40 $P --nproc 2 --inject hang-rank@1 --timeout 10 --out $W/hang-probe &
run healthy-torchrun 90 $TR --out $W/healthy-torchrun &
run kill-torchrun 90 $TR --inject kill-rank@1 --timeout 15 --out $W/kill-torchrun &
run fp-pytest ${PYTEST_S:-170} $PY -m pytest -m gpu -p no:cacheprovider -n 4 -x -v -rA --basetemp=$W/pt tests/test_fingerprint.py &
else  # second call: the torchrun cases the first did not cover, and healthy coverage on both launchers
run healthy-probe 60 $P --nproc 2 --out $W/healthy-probe &
run healthy-torchrun 90 $TR --out $W/healthy-torchrun &
run hang-torchrun 90 $TR --inject hang-rank@1 --timeout 10 --out $W/hang-torchrun &
run extra-torchrun 90 $TR --inject extra-collective@1 --timeout 20 --out $W/extra-torchrun &
fi
wait
$PY - $W "$OUT/h14b.json" <<'PY' | tee "$OUT/h14b-summary.txt"
import json, pathlib, sys
W = pathlib.Path(sys.argv[1]); out = {"machine": (W / "machine.log").read_text()}
print(out["machine"])
for log in sorted(W.glob("*.log")):
    if log.stem == "machine":
        continue
    rep = W / log.stem / "report.json"
    r = json.loads(rep.read_text()) if rep.is_file() else None
    text = log.read_text()
    out[log.stem] = {"log_tail": text[-8000:], "report": r is not None,
                     "total_s": r and r.get("timings", {}).get("total_s"), "ranks_missing": r and r.get("ranks_missing"),
                     "points": r and len(r["points"]), "points_compared": r and sum(len(p["per_rank"]) == 2 for p in r["points"]),
                     "allreduce": r and {k: v for k, v in r["allreduce"].items() if k != "records"},
                     "findings": r and [(f["severity"], f["kind"], f["where"], f["ranks"], f["line"][:400]) for f in r["findings"]],
                     "flight_recorder": r and r.get("flight_recorder")}
    print("=====", log.stem, "|", text.strip().splitlines()[-1] if text.strip() else "", "| report:", r is not None,
          "| total_s", out[log.stem]["total_s"], "| missing", out[log.stem]["ranks_missing"],
          "| points", out[log.stem]["points"], "compared on 2 ranks", out[log.stem]["points_compared"], "| allreduce", out[log.stem]["allreduce"])
    for f in out[log.stem]["findings"] or []:
        print("   ", f[0], f[1], f[2], f[3], f[4][:300])
    if r is None or log.stem == "fp-pytest":
        print("\n".join(text.splitlines()[-40:]))
json.dump(out, open(sys.argv[2], "w"), indent=1, default=str)
PY
