"""The model sources by name: the one place the probe, the CLI, invariance, `tpprobe layers`/`fix`/`accept` and
the reports ask which engine a run uses, and what it takes (tpprobe.engines.engine.Engine).

`--engine builtin | sglang | vllm` names the source; `--model package.module:factory` makes it a user's
(`USER`); `--backend` is the communication backend only (auto, gloo, nccl). Torch-free at import.
"""
from __future__ import annotations

from typing import Optional

from ..config.options import ENGINE_NAMES
from ..core.errors import UsageError
from .builtin.engine import BuiltinEngine
from .engine import Engine
from .sglang.engine import SGLangEngine
from .user import UserEngine
from .vllm.engine import VLLMEngine

BUILTIN, SGLANG, VLLM = BuiltinEngine(), SGLangEngine(), VLLMEngine()
ENGINES: dict[str, Engine] = {e.name: e for e in (BUILTIN, SGLANG, VLLM)}      # --engine's values
SERVING = tuple(e for e in ENGINES.values() if e.serving)
USER = UserEngine(SERVING)
RULE_ENGINES = {n: e for n, e in ENGINES.items() if e.has_capture_rule}      # `tpprobe layers/fix --engine`
DRAFT_ENGINES = {n: e for n, e in ENGINES.items() if e.has_draft_class}     # `tpprobe accept --engine`


def named(name: str) -> Engine:
    """The engine --engine names; UsageError for another name."""
    if name not in ENGINES:
        raise UsageError(f"unknown --engine {name!r}: use {', '.join(ENGINE_NAMES[:-1])} or {ENGINE_NAMES[-1]}")
    return ENGINES[name]


def source(engine: str, model: Optional[str]) -> Engine:
    """The source a run builds: a user's --model factory, else the engine --engine names."""
    return USER if model else named(engine)


def engine_of(opts) -> Engine:
    """The source a ProbeOptions (or InvarianceOptions' probe) builds."""
    return source(opts.engine, opts.model)


def rule_engine(name: str) -> Engine:
    """The engine whose EAGLE-3 capture rule `tpprobe layers` / `tpprobe fix --engine` apply."""
    if name not in RULE_ENGINES:
        raise UsageError(f"--engine {name!r}: use {' or '.join(RULE_ENGINES)}")
    return RULE_ENGINES[name]


def recorded(settings: dict) -> Engine:
    """The engine a capture folder's run used, from its settings (a plugin's or a probe's "backend" line);
    the built-in model's for a run of neither serving engine."""
    backend = str(settings.get("backend", ""))
    return next((e for e in SERVING if backend.startswith(e.settings_prefix)), BUILTIN)


def slot_engine(opts, target) -> Engine:
    """Whose capture-id rule the target's packed aux follows: its engine's; for a --model, the engine whose
    classes built it (or the one --engine names)."""
    engine = engine_of(opts)
    if engine is not USER:
        return engine
    return next((e for e in SERVING if e.made(target)), ENGINES[opts.engine])


def check_faults(engine: Engine, names: list[str]) -> None:
    """Every --inject name is one `engine` makes; else one line naming the engine that makes it."""
    if not names:
        return
    if not engine.faults:
        makers = [f"--engine {e.name}" for e in SERVING if e.faults]
        raise UsageError(f"--inject works on the built-in model and on {' or '.join(makers)}, not on --model")
    refused = [n for n in names if n in BUILTIN.faults and n not in engine.faults and n not in engine.fault_aliases]
    if refused:
        raise UsageError(f"--inject {refused[0]} breaks the built-in model; with --engine {engine.name} inject "
                         f"{', '.join(engine.faults)}")
    for n in names:
        if n in engine.fault_aliases:
            alias = engine.fault_aliases[n]
            raise UsageError(f"--inject {n} is named {alias} on {engine.title}'s model: --engine {engine.name} "
                             f"--inject {alias}")
    for other in SERVING:
        theirs = [n for n in names if n in other.faults and n not in engine.faults]
        if theirs:
            raise UsageError(f"--inject {theirs[0]} breaks {other.breaks}: add --engine {other.name}")
