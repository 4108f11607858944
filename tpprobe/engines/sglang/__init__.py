"""SGLang support: probe SGLang's own models (CPU test mode) and a plugin for live servers.

Modules:
  layer_ids  what EAGLE-3 layer ids capture under SGLang's rules (rules: derived from SGLang's code on a
             rules_shell; rules_table: the tabulated 0.5.23 rules, replayed by rules_replay), read
             without importing SGLang
  cpu_mode   every workaround SGLang 0.5.23 needs to run on CPU (imported only by the CPU mode)
  dist       publish SGLang's parallel state over an already-initialized torch.distributed world
  tiny       tiny random-weight SGLang targets for `tpprobe probe --engine sglang` (tiny_archs: the
             architectures and their configs; tiny_weights: the seeded weights and HF's reference)
  faults     --inject for SGLang's own models; audit, stream: the audit's door and layer extensions
  plugin     `sglang.srt.plugins` entry point for live servers (GPU path: never imports cpu_mode),
             its settings declared in options
"""
from __future__ import annotations

import importlib.util

INSTALL_HINT = "bash ci/sglang-cpu/install.sh .venv"
SGLANG_VERSION = "0.5.23"               # the release the CPU tier pins (ci/sglang-cpu/install.sh)
TESTED_VERSIONS = (SGLANG_VERSION,)     # the releases tpprobe.engines.sglang was tested against


def installed_version():
    """The installed sglang's version (package metadata; nothing imported), or None."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def version_line() -> str:
    """What the plugin says at start-up: the SGLang it found and whether it was tested with it."""
    v = installed_version()
    tested = ", ".join(TESTED_VERSIONS)
    if v is None:
        return f"SGLang not found by its package metadata (tpprobe is tested with {tested})"
    if v in TESTED_VERSIONS:
        return f"SGLang {v} found: a version tpprobe is tested with"
    return (f"SGLang {v} found: NOT a version tpprobe is tested with ({tested}); the plugin follows SGLang's "
            f"internals, so a capture may fail or miss points (each step's line says so)")


def available() -> bool:
    """True when sglang can be found (does not import it)."""
    return importlib.util.find_spec("sglang") is not None


def require() -> None:
    """Raise UsageError naming the install command when sglang is missing."""
    if not available():
        from tpprobe.core.errors import UsageError

        raise UsageError(f"sglang is not installed: on CPU run `{INSTALL_HINT}` "
                         f"(on GPUs: pip install 'sglang=={SGLANG_VERSION}', the release tpprobe is tested with)")
