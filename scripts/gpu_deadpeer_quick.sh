#!/usr/bin/env bash
# The shortest check of a dead and a hung peer over NCCL (tpprobe probe --nproc 2), side by side.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TPPROBE_STACKS_AFTER=24
rm -rf /tmp/dq; mkdir -p /tmp/dq
for spec in kill-rank@1 hang-rank@1; do
  (s=$(date +%s); timeout -k 2 40 python3 -m tpprobe probe --nproc 2 --backend nccl --quiet --timeout 8 \
     --inject $spec --out /tmp/dq/$spec > /tmp/dq/$spec.log 2>&1; echo "rc=$? wall=$(( $(date +%s) - s ))" >> /tmp/dq/$spec.log) &
done
wait
for spec in kill-rank@1 hang-rank@1; do
  echo "=== $spec"; tail -c 2500 /tmp/dq/$spec.log
  python3 -c "
import json,sys
r=json.load(open('/tmp/dq/$spec/report.json'))
print('total_s', r['timings'].get('total_s'), 'missing', r.get('ranks_missing'))
for f in r['findings']: print(' ', f['severity'], f['kind'], f['ranks'], f['line'][:600])
print('FR', json.dumps(r.get('flight_recorder'))[:500])" 2>&1 | tail -8
done | tee $OUT/deadpeer-quick.txt
