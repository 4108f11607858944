"""vLLM as a model source (`--engine vllm`): its own model classes on the probe's gloo world (tiny), its
capture-id rule (layer_ids: the ids as written), its faults and its model runners' reading of a draft's ids."""
from __future__ import annotations

from ...config.fault_names import BOTH, VLLM
from ..engine import ServingEngine

# the architectures whose vLLM model cannot capture the embedding (-1): their default ids are SGLang's
# DeepSeek ids, 0,2,4 (DeepseekV2Model raises for id 0 = before layer 0; tests/engines/vllm/test_vllm_probe.py)
NO_EMBED_ID = ("deepseek_v2", "deepseek_v3", "kimi_k2")


class VLLMEngine(ServingEngine):
    name = "vllm"
    title = "vLLM"
    faults = VLLM + BOTH
    fault_aliases = {"capture-no-residual": "aux-no-residual"}
    breaks = "vLLM's EAGLE-3 capture"
    offset_rule = False
    invariance = False
    model_runners = ("v1", "v2")
    settings_prefix = "vllm"
    module_prefix = "vllm."

    def default_layer_ids(self, arch: str, num_layers: int) -> list[int]:
        if arch in NO_EMBED_ID:
            from ..sglang.tiny_archs import default_layer_ids
            return default_layer_ids(arch, num_layers)
        return super().default_layer_ids(arch, num_layers)

    def check_arch(self, opts, world: int) -> None:
        """The arch it builds and its shapes over tp."""
        from .tiny import check_arch, check_tp
        check_tp(check_arch(opts.arch), world, opts.config, opts.num_experts)

    def check_with_model(self, model: str) -> None:
        from ...core.errors import UsageError
        raise UsageError("--engine vllm builds vLLM's tiny models; with --model your factory builds the model: "
                         "drop --engine vllm")

    def preload(self, arch: str):
        from .tiny import preload
        return lambda: preload(arch)

    def build(self, ctx, opts, layer_ids: list[int]):
        from .tiny import build_target
        return build_target(ctx, arch=opts.arch, num_layers=opts.num_layers, tokens=opts.tokens, seed=opts.seed,
                            dtype=opts.torch_dtype, layer_ids=layer_ids, config_path=opts.config,
                            num_experts=opts.num_experts, vocab=opts.vocab_size)

    def register_tap(self) -> None:
        from . import audit  # noqa: F401  registers vLLM's coordinator door with the Tap

    def inject(self, faults: list, target, ctx, groups: dict) -> None:
        from .faults import inject
        for f in faults:
            inject(f.name, target.model, f.arg, ctx)

    def expected_slots(self, target, layer_ids: list[int]):
        # vLLM's rule: slots in ascending id (tpprobe.engines.vllm.tiny)
        if target.packed_aux is None:
            return None
        from .tiny import expected_slots
        return expected_slots(layer_ids)

    def all_layer_rows(self, ids, num_layers: int) -> list[dict]:
        from .layer_ids import all_rows
        return all_rows(ids, num_layers)

    def rules_source(self) -> str:
        from . import installed_version, layer_ids
        return (f"vLLM {layer_ids.version()}'s code, tabulated" if layer_ids.use_table()
                else f"derived from the installed vLLM {installed_version()}")

    def served_ids(self, draft: dict, runner: str):
        from .layer_ids import config_ids
        return config_ids(draft, runner)[0], []
