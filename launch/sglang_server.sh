#!/usr/bin/env bash
# Start an SGLang server (GPUs) with the tpprobe plugin capturing the first forward steps of
# every TP rank, and an EAGLE-3 draft model, so `tpprobe report` can check the ranks offline.
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct DRAFT=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B TP=2 \
#     bash launch/sglang_server.sh [extra launch_server args...]
#   # send one request, then:
#   tpprobe report "$TPPROBE_CAPTURE_DIR"      (every step; names the first where ranks diverge)
#
# Needs: pip install -e /path/to/tpprobe (this checkout; it never changes the server's stack), in the server's environment (the entry point
# `sglang.srt.plugins: tpprobe` must be installed; SGLANG_PLUGINS=tpprobe whitelists it).
# Settings (see tpprobe/engines/sglang/plugin.py): TPPROBE_MAX_STEPS (default 1), TPPROBE_FORWARD_MODES
# (default extend), TPPROBE_KEEP (default none: fingerprints only), TPPROBE_KEEP_TOKENS,
# TPPROBE_MAX_BYTES (default 2e9 per rank, for kept tensors, checked before each copy). Each TP rank prints one
# "[tpprobe pid=...] tp_rank r/N: hooking ..." line; no such line = the plugin did not load.
set -euo pipefail
: "${MODEL:?set MODEL (HF id or path of the target model)}"
: "${DRAFT:?set DRAFT (EAGLE-3 draft model id or path)}"
TP=${TP:-2}
PORT=${PORT:-30000}
export TPPROBE_CAPTURE_DIR=${TPPROBE_CAPTURE_DIR:-$PWD/tpprobe-runs/sglang-$(date +%Y%m%d-%H%M%S)}
export TPPROBE_MAX_STEPS=${TPPROBE_MAX_STEPS:-1}
export TPPROBE_FORWARD_MODES=${TPPROBE_FORWARD_MODES:-extend}
export SGLANG_PLUGINS=${SGLANG_PLUGINS:-tpprobe}
mkdir -p "$TPPROBE_CAPTURE_DIR"
echo "tpprobe: capturing to $TPPROBE_CAPTURE_DIR (first $TPPROBE_MAX_STEPS $TPPROBE_FORWARD_MODES step(s) per rank)"
exec python -m sglang.launch_server \
  --model-path "$MODEL" --tp-size "$TP" --port "$PORT" \
  --speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT" \
  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  "$@"
