"""A user's model as a model source (`--model package.module:factory`): the factory builds the ProbeTarget on each
rank; its depth is known only then, and no fault is injected into it."""
from __future__ import annotations

import importlib
import sys

from ..core.errors import TPProbeError, UsageError
from .engine import Engine


class UserEngine(Engine):
    name = "model"
    title = "--model"

    def __init__(self, serving: tuple[Engine, ...] = ()):
        self.serving_engines = serving     # the engines whose classes a factory may build its model of

    def model_label(self, opts) -> str:
        return opts.model

    def build(self, ctx, opts, layer_ids: list[int]):
        return self.user_target(ctx, opts.model)

    def user_target(self, ctx, spec: str):
        from ..core.target import ProbeTarget
        mod_name, _, fn_name = spec.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise UsageError(f"--model {spec}: cannot import the module {mod_name!r} ({e}); "
                             f"check the module is on PYTHONPATH") from e
        fn = getattr(mod, fn_name, None)
        if not callable(fn):
            names = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == mod.__name__)
            raise UsageError(f"--model {spec}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no factory "
                             f"{fn_name!r}{'; it defines ' + ', '.join(names[:8]) if names else ''}")
        try:
            target = fn(ctx)
        except TPProbeError:
            raise
        except Exception as e:
            raise UsageError(f"--model {spec}: the factory raised {type(e).__name__}: {e}"
                             f"{'' if '--debug' in sys.argv else '; run with --debug for the traceback'}") from e
        if not isinstance(target, ProbeTarget):
            raise UsageError(f"--model {spec}: the factory returned {type(target).__name__}, expected "
                             f"tpprobe.ProbeTarget(model=..., forward=..., input_ids=..., ...)")
        for engine in self.serving_engines:      # a model of an engine's classes: that engine's taps and doors
            if any(type(m).__module__.startswith(engine.module_prefix) for m in target.model.modules()):
                engine.register_tap()
        return target
