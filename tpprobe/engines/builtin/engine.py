"""The built-in model as a model source (`--engine builtin`, the default): tpprobe's own TP model, shaped by
--num-layers/--hidden/--heads/--ffn/--vocab/--embed-std, broken by every fault of the catalogue it makes."""
from __future__ import annotations

from ...config.fault_names import BUILTIN_TOO, FAULTS, SGLANG_ONLY, VLLM
from ..engine import Engine


class BuiltinEngine(Engine):
    name = "builtin"
    title = "built-in"
    builtin_shapes = True
    # every fault but the serving engines' own (capture-no-residual: its own capture code makes it too)
    faults = tuple(n for n in FAULTS if n not in SGLANG_ONLY + VLLM or n in BUILTIN_TOO)

    def check_model(self, opts, world: int) -> None:
        from .model import BuiltinConfig
        BuiltinConfig.from_options(opts).validate(world)

    def build(self, ctx, opts, layer_ids: list[int]):
        from .model import BuiltinConfig, build_builtin
        return build_builtin(ctx, BuiltinConfig.from_options(opts, layer_ids))

    def inject(self, faults: list, target, ctx, groups: dict) -> None:
        from .faults import apply
        apply(faults, target, ctx, groups)

    def reference_streams(self, opts):
        from .model import BuiltinConfig, reference_streams
        return reference_streams(BuiltinConfig.from_options(opts))
