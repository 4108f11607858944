"""SGLang support: probe SGLang's own models (CPU test mode) and a plugin for live servers.

Modules:
  cpu_mode  every workaround SGLang 0.5.23 needs to run on CPU (imported only by the CPU mode)
  dist      publish SGLang's parallel state over an already-initialized torch.distributed world
  tiny      tiny random-weight SGLang Llama / DeepSeek-V2 targets for `tpprobe probe --backend sglang`
  plugin    `sglang.srt.plugins` entry point for live servers (GPU path: never imports cpu_mode)
"""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "bash ci/sglang-cpu/install.sh .venv"
SGLANG_VERSION = "0.5.23"


def available() -> bool:
    """True when sglang can be found (does not import it)."""
    return importlib.util.find_spec("sglang") is not None


def require() -> None:
    """Raise UsageError naming the install command when sglang is missing."""
    if not available():
        from tpprobe.errors import UsageError

        raise UsageError(f"sglang is not installed: on CPU run `{INSTALL_HINT}` "
                         f"(on GPUs: pip install 'tpprobe[sglang]')")
