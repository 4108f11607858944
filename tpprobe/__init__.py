"""tpprobe: a debugger for tensor-parallel LLM inference (SGLang / vLLM, EAGLE-3 aux hidden states).

The names a user imports: `ProbeTarget` and `RankContext` (to probe your own model with
`--model package.module:factory`), `Tap` (the scoped hooks), `load_run` (read a capture folder
safely) and `run_checks` (the checks, offline).
"""
__version__ = "0.1.0"

from .target import ProbeTarget, RankContext  # noqa: E402
from .hooks import Tap  # noqa: E402
from .capture import load_run  # noqa: E402
from .checks import run_checks  # noqa: E402

__all__ = ["ProbeTarget", "RankContext", "Tap", "load_run", "run_checks", "__version__"]
