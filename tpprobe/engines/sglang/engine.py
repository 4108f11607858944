"""SGLang as a model source (`--engine sglang`): its own model classes on the probe's gloo/NCCL world (tiny),
its capture-id rule (layer_ids), its faults, its DP attention and its EAGLE-3 draft class."""
from __future__ import annotations

from typing import Optional

from ...config.fault_names import BOTH, SGLANG_ONLY, SGLANG_TOO
from ..engine import ServingEngine


class SGLangEngine(ServingEngine):
    name = "sglang"
    title = "SGLang"
    faults = SGLANG_ONLY + SGLANG_TOO + BOTH
    breaks = "SGLang's serving path"
    dp_attention = True
    settings_prefix = "sglang"
    module_prefix = "sglang."
    has_draft_class = True
    draft_cpu_only = True

    def default_layer_ids(self, arch: str, num_layers: int) -> list[int]:
        # ids valid under the architecture's own rule (DeepSeek: 0,2,4 where Llama takes -1,1,3)
        from .tiny_archs import default_layer_ids
        return default_layer_ids(arch, num_layers)

    def default_dtype(self, config: Optional[str]) -> str:
        from ...config.options import config_dtype
        return config_dtype(config) if config else "float32"

    def check_tp(self, opts, world: int) -> None:
        from .tiny_archs import canonical_arch, check_tp
        check_tp(canonical_arch(opts.arch), opts.config, world, opts.dp_attention, opts.num_experts)

    def preload(self, arch: str):
        from .tiny import preload
        return lambda: preload(arch)

    def build(self, ctx, opts, layer_ids: list[int]):
        from .tiny import build_target
        return build_target(ctx, arch=opts.arch, num_layers=opts.num_layers, tokens=opts.tokens, seed=opts.seed,
                            dtype=opts.torch_dtype, layer_ids=layer_ids, config_path=opts.config,
                            attn_dp=opts.dp_attention, num_experts=opts.num_experts, vocab=opts.vocab_size)

    def register_tap(self) -> None:
        from . import stream  # noqa: F401  registers SGLang's layer extensions with the Tap

    def inject(self, faults: list, target, ctx, groups: dict) -> None:
        from .faults import inject
        for f in faults:
            inject(f.name, target.model, f.arg, ctx)

    def made(self, target) -> bool:
        return str(target.info.get("backend", "")).startswith(self.settings_prefix)

    def expected_slots(self, target, layer_ids: list[int]):
        # SGLang's capture-id rules per arch (DeepSeek: +1 only when the first id is 1)
        from .layer_ids import expected_slots, plan
        from .tiny_archs import ARCHES
        if target.arch in ARCHES:
            return expected_slots(plan(target.arch, target.model_layer_ids, target.num_layers))
        return None

    def all_layer_rows(self, ids, num_layers: int) -> list[dict]:
        from .layer_ids import all_rows
        return all_rows(ids, num_layers)

    def rules_source(self) -> str:
        from . import rules_replay
        return ("SGLang 0.5.23's code, tabulated" if rules_replay.use_table() else
                f"derived from the installed SGLang {rules_replay.installed_version()}")

    def served_ids(self, draft: dict, runner: str):
        # the target side reads only eagle_config.eagle_aux_hidden_state_layer_ids (spec_aux_hidden_state.py)
        eagle = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else None
        nested = (eagle or {}).get("eagle_aux_hidden_state_layer_ids")
        top = draft.get("eagle_aux_hidden_state_layer_ids")
        ids = nested if (eagle is not None and (eagle or {}).get("use_aux_hidden_state", True)) else None
        notes = []
        if nested is None and top is not None:
            notes.append(f"the draft's ids {top} are at the top level of its config: SGLang's target side reads "
                         f"only eagle_config.eagle_aux_hidden_state_layer_ids, so the target uses its default "
                         f"capture")
        return ids, notes

    def importable(self) -> bool:
        try:
            import sglang  # noqa: F401
        except ImportError:
            return False
        return True

    def draft_forward(self, draft):
        from . import SGLANG_VERSION
        from .eagle3_draft import SGLangEagle3
        return SGLangEagle3(draft), f"sglang {SGLANG_VERSION} LlamaForCausalLMEagle3 (CPU)"
