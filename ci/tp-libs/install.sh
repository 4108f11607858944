#!/usr/bin/env bash
# The TP-libraries tier (tests/libs/test_tp_libs.py, marker tplibs): transformers 5.19.0 with accelerate
# 1.15.0, and megatron-core 0.16.1, CPU-only, pinned and idempotent. torch's own DTensor TP needs
# nothing beyond torch.
#
#   bash ci/tp-libs/install.sh .venv     # into that venv (must already exist, with torch)
#   bash ci/tp-libs/install.sh           # into the current `python`
#
# Prerequisite: torch==2.13.0 (CPU build) already installed. Everything here is `--no-deps`, so pip
# can never replace the CPU torch with a CUDA one (accelerate and megatron-core declare torch). The
# transformers pins are SGLang's (ci/sglang-cpu/requirements-nodeps.txt): one venv holds both
# tiers, and a pin that differs from SGLang's is refused here. Re-running is a no-op (a few seconds).
# Into a venv holding only torch it adds 248 MB in about 70 s (measured: docs/development.md).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REQ="$HERE/requirements-nodeps.txt"
if [ $# -ge 1 ] && [ -n "$1" ]; then
  PY="$1/bin/python"
  [ -x "$PY" ] || { echo "install.sh: $PY not found: create the venv first (python3 -m venv $1)" >&2; exit 2; }
else
  PY=$(command -v python || command -v python3)
fi

"$PY" - <<'PYEOF' || { echo "install.sh: torch 2.13.0 (CPU) must be installed first: $PY -m pip install torch==2.13.0" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)
PYEOF

# the same package pinned differently here and in the SGLang tier would make the two tiers fight
"$PY" - "$REQ" "$HERE/../sglang-cpu/requirements-nodeps.txt" <<'PYEOF'
import os, sys
def pins(path):
    if not os.path.exists(path):
        return {}
    out = {}
    for line in open(path):
        p = line.split("#")[0].strip()
        if "==" in p:
            n, v = p.split("==")
            out[n.strip().lower().replace("_", "-")] = v.strip()
    return out
mine, sgl = pins(sys.argv[1]), pins(sys.argv[2])
bad = [f"{n}=={v} (SGLang's tier: {sgl[n]})" for n, v in mine.items() if n in sgl and sgl[n] != v]
if bad:
    sys.exit("install.sh: pins differ from ci/sglang-cpu: " + ", ".join(bad))
PYEOF

if "$PY" - "$REQ" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
def ok(name, v):
    try:
        return version(name) == v
    except PackageNotFoundError:
        return False
pins = [l.split("#")[0].strip() for l in open(sys.argv[1])]
sys.exit(0 if all(ok(*p.split("==")) for p in pins if "==" in p) else 1)
PYEOF
then
  echo "install.sh: tp-libs tier (transformers, accelerate, megatron-core) already installed"
  exit 0
fi

"$PY" -m pip install -q --no-deps -r "$REQ"
"$PY" - <<'PYEOF'
import warnings
import torch
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
warnings.simplefilter("ignore")          # megatron-core says Transformer Engine / Apex are absent
import accelerate, transformers, megatron.core                           # noqa: F401
from transformers import DistributedConfig                               # noqa: F401
from megatron.core.models.gpt import GPTModel                            # noqa: F401
print(f"install.sh: transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"megatron-core {megatron.core.__version__} (CPU) importable with torch {torch.__version__}")
PYEOF
