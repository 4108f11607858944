"""The tiny SGLang models' architectures: names, shapes, configs (tiny or a user's config.json), TP checks.

Torch-free at import: the launcher and option parsing read it before any rank starts; the model
itself is built by tiny.py, its weights by tiny_weights.py.
"""
from __future__ import annotations

from typing import Optional

from tpprobe.config.hub import read_config, try_read
from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang import layer_ids as lid

ARCHES = ("llama", "deepseek_v2", "qwen3", "qwen3_moe", "qwen2")

# HF model_type -> tpprobe arch
_MODEL_TYPES = {"llama": "llama", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2",
                "kimi_k2": "deepseek_v2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2": "qwen2"}
# tpprobe arch -> (SGLang model module, SGLang class)
SGLANG_CLASSES = {"llama": ("llama", "LlamaForCausalLM"),
                   "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
                   "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                   "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                   "qwen2": ("qwen2", "Qwen2ForCausalLM")}
# arch -> names accepted by --arch (SGLang's class / HF model_type aliases)
ARCH_ALIASES = {"llamaforcausallm": "llama", "deepseek_v3": "deepseek_v2", "kimi_k2": "deepseek_v2",
                "kimi": "deepseek_v2", "deepseekv2forcausallm": "deepseek_v2",
                "deepseekv3forcausallm": "deepseek_v2", "qwen3forcausallm": "qwen3",
                "qwen3moeforcausallm": "qwen3_moe", "qwen2forcausallm": "qwen2"}


def canonical_arch(arch: Optional[str]) -> Optional[str]:
    """--arch as given -> the tiny-model arch (llama, deepseek_v2, qwen3, qwen3_moe, qwen2)."""
    if arch is None:
        return None
    a = arch.strip().lower().replace("-", "_")
    return ARCH_ALIASES.get(a, a)


def config_arch_and_layers(config_path: str) -> tuple[Optional[str], Optional[int]]:
    """(tiny-model arch, num_hidden_layers) a config.json names, read through tpprobe.config.hub (a
    wrapper's text model under `text_config`: Kimi-K2.5's DeepSeek-V3): the arch from the text model's
    class (DeepseekV3ForCausalLM -> deepseek_v2) or model_type; None for what it does not name.
    UsageError for a file that is no JSON config, or an architecture the SGLang backend does not build."""
    hub = read_config(config_path)
    L = hub.num_layers
    mt = hub.model_type
    if hub.wrapper and mt not in _MODEL_TYPES:
        raise UsageError(f"--config {config_path} is a {hub.describe()} model, text model_type {mt!r}; the SGLang "
                         f"backend builds the text models {', '.join(sorted(_MODEL_TYPES))} (`tpprobe layers --arch "
                         f"{hub.architecture}` says what its EAGLE-3 ids capture)")
    for a in (hub.text_architecture, hub.architecture):
        if isinstance(a, str) and canonical_arch(a) in ARCHES:
            return canonical_arch(a), L
    if mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt], L
    if hub.architecture or mt:
        named = hub.text_architecture or hub.architecture or mt
        raise UsageError(f"--config {config_path} is a {hub.describe()} model (model_type {mt!r}); the SGLang "
                         f"backend builds {', '.join(ARCHES)} (`tpprobe layers --arch {named}` says what its "
                         f"EAGLE-3 ids capture)")
    return None, L


# the tiny models' shapes (tiny_config); validate() checks them against the TP size before any rank starts.
# 8 attention heads everywhere, so every tiny model splits over tp 1, 2, 4 and 8 (Kimi-K2's serving shape);
# 4 KV heads are replicated at tp 8 as SGLang does for any tp over the KV heads; 8 experts, since SGLang's
# MoE refuses a tp over the number of experts.
TINY_SHAPES = {
    "llama": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen2": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen3": {"heads": 8, "kv_heads": 4, "ffn": 128},
    "qwen3_moe": {"heads": 8, "kv_heads": 4, "ffn": 128, "moe_ffn": 32, "experts": 8},
    "deepseek_v2": {"heads": 8, "ffn": 128, "moe_ffn": 32, "experts": 8},     # MLA: no KV heads to split
}


def shape_of(arch: str, config_path: Optional[str] = None, num_experts: Optional[int] = None) -> dict:
    """The sizes tensor parallelism splits, for the tiny model of `arch` or a config.json (its text
    model's; `num_experts` as --num-experts shrinks them)."""
    if not config_path:
        out = dict(TINY_SHAPES[arch])
        if num_experts and "experts" in out:
            out["experts"] = num_experts
        return out
    hub = try_read(config_path)
    d = hub.text if hub is not None else {}
    out = {}
    for key, names in (("heads", ("num_attention_heads",)), ("kv_heads", ("num_key_value_heads",)),
                       ("ffn", ("intermediate_size",)), ("moe_ffn", ("moe_intermediate_size",)),
                       ("experts", ("n_routed_experts", "num_experts", "num_local_experts"))):
        v = next((d[n] for n in names if isinstance(d.get(n), int) and d[n] > 0), None)
        if v is not None:
            out[key] = v
    if arch == "deepseek_v2":
        out.pop("kv_heads", None)        # MLA: the latent KV is not split over ranks
    if num_experts and "experts" in out:
        out["experts"] = num_experts
    return out


# The architectures whose SGLang attention runs over the attention-TP group under DP attention: their
# attention splits heads over get_parallel().attn_tp_size with parallel_group="attn_tp" (qwen3.py,
# qwen3_moe.py, deepseek_v2.py). SGLang 0.5.23's llama.py and qwen2.py split heads over the whole
# get_parallel().tp_size and never gather or scatter the attention-DP groups' tokens: with DP attention on,
# their o_proj reduces over the whole TP group while the embedding and logits run per attention-TP group.
DP_ATTENTION_ARCHES = ("qwen3", "qwen3_moe", "deepseek_v2")


def check_dp_attention(arch: str, config_path: Optional[str], attn_dp: int) -> None:
    """UsageError (one line) for DP attention on an architecture whose SGLang model has none."""
    if attn_dp <= 1 or arch in DP_ATTENTION_ARCHES or arch not in SGLANG_CLASSES:
        return
    module, cls = SGLANG_CLASSES[arch]
    model = f"--config {config_path} ({arch})" if config_path else f"--arch {arch}"
    raise UsageError(f"{model} with --dp-attention {attn_dp}: SGLang's {cls} (sglang/srt/models/{module}.py) has "
                     f"no DP attention (its attention splits heads over the whole TP group, never over an "
                     f"attention-TP group); DP attention runs on --arch {', '.join(DP_ATTENTION_ARCHES[:-1])} or "
                     f"{DP_ATTENTION_ARCHES[-1]} (deepseek_v3, kimi_k2): use one of them or drop --dp-attention")


def check_tp(arch: str, config_path: Optional[str], tp: int, attn_dp: int = 1,
             num_experts: Optional[int] = None) -> None:
    """UsageError (one line, what to pass) when the model's heads / KV heads / MLP widths do not
    split over `tp` ranks (attention over tp / attn_dp), or DP attention is asked of an architecture
    without it; runs before any rank starts."""
    check_dp_attention(arch, config_path, attn_dp)
    shape = shape_of(arch, config_path, num_experts)
    attn_tp = max(tp // max(attn_dp, 1), 1)

    def fits(t: int, a: int) -> list[str]:
        bad = []
        if "heads" in shape and shape["heads"] % a:
            bad.append(f"its {shape['heads']} attention heads do not split over {a} ranks")
        kv = shape.get("kv_heads")
        if kv and kv % a and a % kv:
            bad.append(f"its {kv} KV heads neither split over nor replicate onto {a} ranks")
        for key, what in (("ffn", "MLP width"), ("moe_ffn", "expert MLP width")):
            if key in shape and shape[key] % t:
                bad.append(f"its {what} {shape[key]} does not split over {t} ranks")
        if "experts" in shape and t > shape["experts"]:
            bad.append(f"its {shape['experts']} experts are fewer than the {t} ranks (SGLang's MoE refuses that)")
        return bad

    bad = fits(tp, attn_tp)
    if bad:
        model = f"--config {config_path}" if config_path else f"--arch {arch}"
        ok = [t for t in range(1, 65) if not fits(t, t)]
        dp = f" --dp-attention {attn_dp}" if attn_dp > 1 else ""
        raise UsageError(f"{model} at tp={tp}{dp}: {'; '.join(bad)}; use --nproc "
                         f"{', '.join(map(str, ok[:-1])) + ' or ' + str(ok[-1]) if len(ok) > 1 else ok[0]}")


def default_layer_ids(arch: str, num_layers: int) -> list[int]:
    """The probe's default ids for `arch`: those that capture the embedding and the streams leaving
    layers 1 and 3 (HF hidden_states[0], [2], [4]) under that architecture's SGLang rule, i.e.
    -1,1,3 where SGLang adds +1 (Llama, Qwen) and 0,2,4 where it uses the ids as given
    (DeepSeek: +1 only when the first id is 1). Shorter for models of fewer layers."""
    L = int(num_layers)
    arch = canonical_arch(arch) or "llama"
    cands = [[i for i in (-1, 1, 3) if i < L - 1], [i for i in (0, 2, 4) if i < L]]
    # the pinned rule of the tiny model's family, so the launcher needs no sglang import; each rank
    # then checks the ids against the rule derived from SGLang (build_target refuses a crash)
    family = "deepseek_v2" if arch == "deepseek_v2" else "llama"
    for ids in cands:
        if ids and not lid.pinned_plan(family, ids, L).problems:
            return ids
    return cands[0] or [-1]


def tiny_config(arch: str, num_layers: int, moe: bool = True):
    """The built-in tiny config (float32) for `arch`."""
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32",
            architectures=["LlamaForCausalLM"])
    common = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float32")
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=8, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # every layer MoE: SGLang 0.5.23's Qwen3-MoE ignores mlp_only_layers (qwen3_moe.py:878)
        return Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=32,
                              num_experts=TINY_SHAPES["qwen3_moe"]["experts"],
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    if arch == "deepseek_v2":
        from transformers import DeepseekV3Config

        c = DeepseekV3Config(
            vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=num_layers, num_attention_heads=TINY_SHAPES["deepseek_v2"]["heads"],
            num_key_value_heads=TINY_SHAPES["deepseek_v2"]["heads"],
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=TINY_SHAPES["deepseek_v2"]["experts"],
            n_shared_experts=1, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=_first_dense(num_layers, moe),
            max_position_embeddings=256,
            # SGLang's CPU rope supports only deepseek_yarn (as real DeepSeek-V3 uses)
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                             "original_max_position_embeddings": 128, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            tie_word_embeddings=False, dtype="float32", rms_norm_eps=1e-6)
        c.architectures = ["DeepseekV3ForCausalLM"]
        return c
    raise UsageError(f"--arch {arch!r} is not supported by the SGLang backend: "
                     f"use one of {', '.join(ARCHES)}")


def _first_dense(num_layers: int, moe: bool) -> int:
    # moe: layer 0 dense, the rest MoE (one layer alone is made MoE); else all dense
    return (1 if num_layers >= 2 else 0) if moe else num_layers


def config_first_dense(num_layers: int, moe: bool = True) -> int:
    """The most leading dense layers a --config DeepSeek model cut to `num_layers` keeps: all but the last
    (one layer alone is made MoE), so a config's own first_k_dense_replace (DeepSeek-V3: 3) survives a cut
    to first_k_dense_replace + 1 layers; without moe, every layer may be dense."""
    return (num_layers - 1 if num_layers >= 2 else 0) if moe else num_layers


def load_config(arch: Optional[str], config_path: str, num_layers: int, moe: bool = True,
                num_experts: Optional[int] = None, vocab: Optional[int] = None):
    """A user's config.json (file or its folder; a wrapper's text model under `text_config`) cut to
    `num_layers` layers, for random weights; `num_experts` / `vocab` shrink what tensor parallelism
    splits the same way at any size (routed experts, vocabulary): hidden size, heads, MLA ranks and
    the dense/MoE layer pattern stay the config's."""
    hub = read_config(config_path)
    d = dict(hub.text)
    if "model_type" not in d:
        raise UsageError(f"--config {config_path}: no 'model_type' in it; expected a HF config.json")
    mt = d["model_type"]
    if mt not in _MODEL_TYPES:
        raise UsageError(f"--config {config_path}: {hub.describe()}, model_type {mt!r}, is not built by the "
                         f"SGLang backend (supported: {', '.join(sorted(_MODEL_TYPES))})")
    if arch is not None and _MODEL_TYPES[mt] != arch:
        raise UsageError(f"--config {config_path} is a {mt} model but --arch is {arch}: "
                         f"use --arch {_MODEL_TYPES[mt]}")
    for drop in ("quantization_config", "auto_map", "_name_or_path"):
        d.pop(drop, None)  # random weights in the probe dtype; never run remote code
    if hub.dtype and "torch_dtype" not in d and "dtype" not in d:
        d["torch_dtype"] = hub.dtype
    if mt == "kimi_k2":
        mt = d["model_type"] = "deepseek_v3"
    d["num_hidden_layers"] = num_layers
    if num_experts:
        for key in ("n_routed_experts", "num_experts", "num_local_experts"):
            if key in d:
                d[key] = num_experts
        if isinstance(d.get("num_experts_per_tok"), int):
            d["num_experts_per_tok"] = min(d["num_experts_per_tok"], num_experts)
        if isinstance(d.get("n_group"), int) and d["n_group"] > 1 and num_experts % d["n_group"]:
            d["n_group"] = d["topk_group"] = 1          # grouped routing needs experts in whole groups
    if vocab:
        d["vocab_size"] = vocab
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(d.get(key), int) and d[key] >= vocab:
                d[key] = vocab - 1
    if _MODEL_TYPES[mt] == "deepseek_v2":     # the config's dense layers first, at least one MoE layer after them
        d["first_k_dense_replace"] = min(int(d.get("first_k_dense_replace", 0)), config_first_dense(num_layers, moe))
        d.pop("num_nextn_predict_layers", None)
    from transformers import AutoConfig

    try:
        c = AutoConfig.for_model(**d)
    except Exception as e:  # noqa: BLE001 - transformers' own validation, one line for the user
        raise UsageError(f"--config {config_path}: transformers rejects it: {e}") from None
    c.num_hidden_layers = num_layers
    if hub.text_architecture:
        c.architectures = [hub.text_architecture]     # the text model's class (vLLM resolves its model by it)
    return c


def arch_of(config) -> str:
    return _MODEL_TYPES[config.model_type]


def config_for(arch, num_layers, config_path, moe, num_experts: Optional[int] = None,
               vocab: Optional[int] = None):
    arch = canonical_arch(arch)
    if arch is not None and arch not in ARCHES:
        raise UsageError(f"--arch {arch!r} is not supported by the SGLang backend: "
                         f"use one of {', '.join(ARCHES)}")
    if num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    if config_path:
        config = load_config(arch, config_path, num_layers, moe, num_experts, vocab)
    else:
        if arch is None:
            raise UsageError("--arch or --config is needed for the SGLang backend")
        config = tiny_config(arch, num_layers, moe)
    if arch_of(config) == "deepseek_v2":
        from tpprobe.engines.sglang.cpu_mode import fill_deepseek_config

        fill_deepseek_config(config)
    return config
