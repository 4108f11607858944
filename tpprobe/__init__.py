"""tpprobe: a debugger for tensor-parallel LLM inference (SGLang / vLLM, EAGLE-3 aux hidden states).

The names a user imports: `ProbeTarget` and `RankContext` (to probe your own model with
`--model package.module:factory`), `Tap` (the scoped hooks), `load_run` (read a capture folder
safely) and `run_checks` (the checks, offline).

The house (one room per concern; imports point one way: commands -> pipeline -> checks -> capture/exchange):
  cli.py, probe.py      the command line; the pipeline every rank runs
  capture/              hooks (the Tap), capture-point names, capture files, parameter hashes
  exchange/             torch.distributed and the store channel, gathers, fingerprints, live progress
  checks/               one module per check family, the evidence they judge, the noise rule, findings
  report/               the report model and its renderers (terminal, HTML, Markdown), environment
  tools/                diff, layers, specforge, offline report
  sglang/               SGLang on CPU, its tiny models, the serving plugin

Names are imported on first use, so `tpprobe --help` and `tpprobe layers` do not load the
hooks and checks (nor torch.distributed) they do not need.
"""
__version__ = "0.1.0"

_PUBLIC = {"ProbeTarget": "tpprobe.target", "RankContext": "tpprobe.target", "Tap": "tpprobe.capture.hooks",
           "load_run": "tpprobe.capture.files", "run_checks": "tpprobe.checks.run"}

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
