"""tpprobe: a debugger for tensor-parallel LLM inference (SGLang / vLLM, EAGLE-3 aux hidden states).

The names a user imports: `ProbeTarget` and `RankContext` (to probe your own model with
`--model package.module:factory`), `Tap` (the scoped hooks), `load_run` (read a capture folder
safely) and `run_checks` (the checks, offline).

The house: one wing (a subpackage) per concern, and imports point one way, down the floors that
tests/house/test_house.py holds: cli -> invariance -> probe -> dumpdir, eagle3 -> report -> engines (builtin/,
sglang/, vllm/, user: the model sources, asked through engines/registry.py) -> checks, exchange -> formats ->
capture -> fingerprint -> config -> core. The layout in docs/architecture.md lists every wing and module.

Names are imported on first use, so `tpprobe --help` and `tpprobe layers` do not load the
hooks and checks (nor torch.distributed) they do not need.
"""
__version__ = "0.1.0"

_PUBLIC = {"ProbeTarget": "tpprobe.core.target", "RankContext": "tpprobe.core.target", "Tap": "tpprobe.capture.hooks",
           "load_run": "tpprobe.formats.capture_dir", "run_checks": "tpprobe.checks.run"}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpprobe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
