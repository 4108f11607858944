#!/usr/bin/env bash
# Install everything the tests need into .venv and run the whole test suite (the README's test
# command; .ci/run calls it). Safe to re-run: each step is a no-op when already done.
#
#   bash scripts/test.sh              # everything
#   bash scripts/test.sh -k faults    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# the CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -c ci/constraints.txt -e ".[test]"
# the SGLang tier: sglang 0.5.23 CPU-only, pinned, --no-deps (the project's own recipe)
bash ci/sglang-cpu/install.sh .venv
# the TP-libraries tier: transformers (SGLang's pin) + accelerate, megatron-core 0.16.1, --no-deps
bash ci/tp-libs/install.sh .venv
# (the bare venv the README's main job is proven on, .venv-bare, is built by tests/test_bare_venv.py)
# Debian's chromium renders the HTML report in a test (root only; the test says how otherwise)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "scripts/test.sh: could not install chromium; the HTML screenshot test will say so" >&2
fi
exec .venv/bin/python -m pytest -q --durations=25 "$@"
