#!/usr/bin/env bash
# Regenerate docs/report-screenshot.png: the HTML report of a real faulty run, rendered by
# headless chromium (Debian: apt-get install -y chromium).
#   scripts/screenshot.sh [OUT_PNG]      (from the repository root; uses .venv/bin/tpprobe if present)
set -euo pipefail
cd "$(dirname "$0")/.."
png=${1:-docs/report-screenshot.png}
tpprobe=.venv/bin/tpprobe; [ -x "$tpprobe" ] || tpprobe=tpprobe
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "no chromium: apt-get install -y chromium" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# a sub-group all-reduce at layer 2 on 4 ranks: two ranks agree with rank 0, two do not
"$tpprobe" probe --nproc 4 --inject subgroup-allreduce@2 --out "$work/run" --html "$work/report.html" --quiet || [ $? -eq 1 ]
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
  --window-size=1280,1800 --screenshot="$work/shot.png" "file://$work/report.html" >/dev/null 2>&1
cp "$work/shot.png" "$png"
echo "wrote $png"
