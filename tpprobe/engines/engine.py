"""What a model source is to the rest of tpprobe: the `Engine` every source (the built-in model, SGLang's
model classes, vLLM's, a user's --model factory) answers as, so the probe, the CLI, invariance and the
plugins ask the source (tpprobe.engines.registry) instead of testing its name.

Each source subclasses `Engine` in its own package (engines/builtin/engine.py, engines/sglang/engine.py,
engines/vllm/engine.py, engines/user.py) and overrides what differs; the defaults here are the
built-in model's. Torch-free at import: `tpprobe probe --help` reads the names, and every method
imports what it needs when it runs.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..core.errors import UsageError


class Engine:
    """A model source. The attributes say what it takes; the methods do what differs per source."""

    name = ""                  # --engine's value ("model" for a user's --model factory)
    title = ""                 # as the reports write it (SGLang, vLLM, built-in)
    serving = False            # a serving engine's own model classes: --arch/--config shape them
    builtin_shapes = False     # --hidden, --heads, --ffn, --vocab, --embed-std shape its model
    faults: tuple = ()         # the --inject names it knows, in the order its messages list them
    fault_aliases: dict = {}   # another source's fault name -> this engine's name for the same fault
    breaks = ""                # what its own faults break ("SGLang's serving path"), for "add --engine NAME"
    # an EAGLE-3 id k captures the output of layer k (HF hidden_states[k+1]): SGLang's rule and the built-in
    # model's; False: the ids are as written (vLLM's, id k = hidden_states[k])
    offset_rule = True
    dp_attention = False       # runs SGLang's DP attention (--dp-attention N)
    invariance = True          # `tpprobe invariance` builds it
    model_runners: tuple = ()  # the model runners that read a draft's ids (`tpprobe layers --vllm-runner`)
    settings_prefix = ""       # settings["backend"] of its runs starts with this (a capture folder's engine)
    module_prefix = ""         # the package its model classes live in (a --model built of them)
    has_draft_class = False    # it has its own EAGLE-3 draft class (`tpprobe accept --engine NAME`)
    draft_cpu_only = False     # ... which runs on CPU only

    def __repr__(self) -> str:
        return f"Engine({self.name})"

    # ---- options: defaults that follow the source --------------------------------------------------
    def default_layer_ids(self, arch: str, num_layers: int) -> list[int]:
        """The default --layers: -1,1,3 fitted to the depth (tpprobe.config.options.builtin_layer_ids)."""
        from ..config.options import builtin_layer_ids
        return builtin_layer_ids(num_layers)

    def default_dtype(self, config: Optional[str]) -> str:
        """The dtype when --dtype is not given."""
        return "float32"

    def check_config(self, config: str) -> None:
        """A --config is the engine's to read (only a serving engine reads one)."""
        raise UsageError(f"--config {config} builds SGLang's model classes: add --engine sglang "
                         f"(the built-in model takes --num-layers/--hidden/--heads/--ffn/--vocab instead)")

    def config_shape(self, config: str) -> tuple[Optional[str], Optional[int]]:
        """The architecture and depth a --config names (None: not named there)."""
        return None, None

    def model_label(self, opts) -> str:
        """The run's model as the settings and the reports name it."""
        return self.name

    # ---- checks before any rank starts (each raises UsageError) ------------------------------------
    def check_arch(self, opts, world: int) -> None:
        """--arch names one of the tiny models (the option's choices; only an engine builds them)."""
        from .sglang.tiny_archs import ARCHES, canonical_arch
        if canonical_arch(opts.arch) not in ARCHES:
            raise UsageError(f"unknown --arch {opts.arch!r}: use {', '.join(ARCHES)} (with --engine sglang)")

    def check_with_model(self, model: str) -> None:
        """--engine NAME with --model: the factory builds the model."""

    def check_model(self, opts, world: int) -> None:
        """The model's own shapes over `world` ranks (with the ids already in range)."""

    def check_tp(self, opts, world: int) -> None:
        """The serving model's shapes over tp, after the faults and DP attention were checked."""

    # ---- on each rank -------------------------------------------------------------------------------
    def preload(self, arch: str) -> Optional[Callable[[], None]]:
        """What the launcher imports once before starting the ranks (None: nothing to warm)."""
        return None

    def build(self, ctx, opts, layer_ids: list[int]):
        """This rank's ProbeTarget."""
        raise NotImplementedError

    def inject(self, faults: list, target, ctx, groups: dict) -> None:
        """Break the built model as --inject asks (faults already checked by `check_faults`)."""

    def register_tap(self) -> None:
        """Register the engine's layer extensions and audit door with the Tap (a model of its classes)."""

    def made(self, target) -> bool:
        """Whether `target`'s model was built of this engine's classes (a --model factory's may be)."""
        return False

    def expected_slots(self, target, layer_ids: list[int]) -> Optional[tuple]:
        """(expected points, expected ids) of the packed aux under this engine's rule; None: by id."""
        return None

    def reference_streams(self, opts) -> Optional[dict]:
        """The streams a single process computes for this model (None: no reference)."""
        return None

    # ---- the capture rule (`tpprobe layers`, `tpprobe fix`) -----------------------------------------
    has_capture_rule = False   # the engine's EAGLE-3 capture rule is tabulated (engines/capture_rule.py)

    def all_layer_rows(self, ids: Optional[list[int]], num_layers: int) -> list[dict]:
        """One row per architecture the engine serves: what its rule captures for `ids`."""
        raise NotImplementedError

    def rules_source(self) -> str:
        """Where the rule's table comes from (a tabulated release, or the installed code)."""
        raise NotImplementedError

    def served_ids(self, draft: dict, runner: str) -> tuple[Optional[list[int]], list[str]]:
        """The ids the target side serves for this draft config, and notes on how it read them."""
        raise NotImplementedError

    # ---- the EAGLE-3 draft class (`tpprobe accept --engine NAME`) -----------------------------------
    def importable(self) -> bool:
        """Its package imports here (for `--engine auto`)."""
        return True

    def draft_forward(self, draft):
        """(the engine's own draft class loaded with `draft`'s weights, a line naming it); None: it has none."""
        return None


class ServingEngine(Engine):
    """A serving engine's own model classes (SGLang's, vLLM's): --arch/--config shape them, and a --config
    reads as the HF config it is (tpprobe.probe.prepare.check_config_file checks the file)."""

    serving = True
    has_capture_rule = True

    def check_config(self, config: str) -> None:
        """It reads a --config."""

    def config_shape(self, config: str):
        from .sglang.tiny_archs import config_arch_and_layers
        return config_arch_and_layers(config)

    def model_label(self, opts) -> str:
        return f"{self.name}:{opts.arch}"
