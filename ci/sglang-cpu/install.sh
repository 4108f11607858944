#!/usr/bin/env bash
# CPU-only install of sglang 0.5.23 (no CUDA, no sgl_kernel), pinned and idempotent.
#
#   bash ci/sglang-cpu/install.sh .venv     # into that venv (must already exist, with torch)
#   bash ci/sglang-cpu/install.sh           # into the current `python`
#
# Prerequisite: torch==2.13.0 (CPU build) already installed (CI: `pip install torch==2.13.0`
# then `pip install -e .[test]`). Everything here is `--no-deps`, so pip can never replace the
# CPU torch with a CUDA one. sglang's metadata pins torch 2.14.1; nothing checks it at run time.
# Re-running is a no-op (about 1 s) when the pinned set and the torchvision shim are in place.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SGLANG_VERSION=0.5.23
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

SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if "$PY" - "$SGLANG_VERSION" "$HERE/requirements-nodeps.txt" "$SP" <<'PYEOF'
import sys, os
from importlib.metadata import version, PackageNotFoundError
want, req, sp = sys.argv[1:4]
def ok(name, v):
    try:
        return version(name) == v
    except PackageNotFoundError:
        return False
pins = [l.split("#")[0].strip() for l in open(req)]
pins = [p.split("==") for p in pins if "==" in p]
good = ok("sglang", want) and all(ok(n, v) for n, v in pins)
good = good and os.path.exists(os.path.join(sp, "_tpprobe_tv_cpu_shim.pth"))
sys.exit(0 if good else 1)
PYEOF
then
  echo "install.sh: sglang $SGLANG_VERSION CPU tier already installed in $SP"
  exit 0
fi

"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q --no-deps -r "$HERE/requirements-nodeps.txt"
# PyPI's torchvision is a CUDA build whose _C.so cannot load on CPU torch; torchvision then fails
# in _meta_registrations.py ("operator torchvision::nms does not exist"). sglang imports it at
# import time. The shim defines those two op schemas right before torchvision is first imported.
cp "$HERE/tv_cpu_shim.py" "$SP/_tpprobe_tv_cpu_shim.py"
echo "import _tpprobe_tv_cpu_shim; _tpprobe_tv_cpu_shim.install()" > "$SP/_tpprobe_tv_cpu_shim.pth"
"$PY" - <<'PYEOF'
import torch
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
import sglang, sglang.srt.models.llama, sglang.srt.models.deepseek_v2  # noqa: F401
print(f"install.sh: sglang {sglang.__version__} (CPU) importable with torch {torch.__version__}")
PYEOF
