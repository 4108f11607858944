"""A model's config.json as it ships, read once: every `--config` / `--target-config` goes through `read_config`.

A hub config is either a text model's own (`architectures: [DeepseekV3ForCausalLM]`, its fields at the top
level) or a wrapper's: a multimodal class (`KimiK25ForConditionalGeneration`, `Qwen3VLForConditionalGeneration`,
`Gemma3ForConditionalGeneration`, ...) whose text model's fields sit under `text_config` (Kimi-K2.5: a
DeepSeek-V3 text model, `model_type` kimi_k2, under a `kimi_k25` wrapper). Both engines build the wrapper
around the text model (SGLang's `KimiK25ForConditionalGeneration.language_model` is its
`DeepseekV3ForCausalLM`; vLLM's likewise) and both capture EAGLE-3 states in the text model, so what
tensor parallelism splits and what a layer id means are the text model's. `HubConfig.text` is that text
model's fields; `architecture` the class named at the top (the wrapper when there is one) and
`text_architecture` the text model's class.

Torch-free: read by the option parsing before any engine is imported, so a config error is said in a
line before SGLang or vLLM loads (tens of seconds).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..core.errors import UsageError

# the text model's class for a `text_config` model_type (when text_config names no `architectures`)
TEXT_ARCH_OF_TYPE = {
    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "llama": "LlamaForCausalLM", "llama4_text": "Llama4ForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM", "mistral": "MistralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# the wrappers SGLang 0.5.23 and vLLM 0.32.0 register around a text model under `text_config`, with
# the text model's class when the config does not say it (sglang/srt/models/*.py, vllm/model_executor/models)
WRAPPERS = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",
    "KimiVLForConditionalGeneration": "DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration": "MiniMaxM3SparseForCausalLM",
}


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass
class HubConfig:
    path: str                              # as the user gave it (a file or its folder)
    raw: dict                              # the whole config.json
    text: dict                             # the text model's fields (text_config, or the config itself)
    architecture: Optional[str]            # the class config.json names first (the wrapper when there is one)
    text_architecture: Optional[str]       # the text model's class
    wrapper: Optional[str]                 # the wrapper's class when the text model is nested, else None

    @property
    def model_type(self) -> Optional[str]:
        """The text model's model_type (kimi_k2 for Kimi-K2.5, whose wrapper's is kimi_k25)."""
        mt = self.text.get("model_type")
        return mt if isinstance(mt, str) else None

    @property
    def num_layers(self) -> Optional[int]:
        L = _int(self.text.get("num_hidden_layers"))
        return L if L is not None and L >= 1 else None

    @property
    def dtype(self) -> Optional[str]:
        for d in (self.text, self.raw):
            v = d.get("torch_dtype") or d.get("dtype")
            if isinstance(v, str):
                return v.removeprefix("torch.")
        return None

    def describe(self) -> str:
        """`KimiK25ForConditionalGeneration (its text model DeepseekV3ForCausalLM, under text_config)`."""
        if self.wrapper:
            return f"{self.wrapper} (its text model {self.text_architecture or self.model_type}, under text_config)"
        return self.architecture or self.model_type or "a model"

    def get(self, *names, default=None):
        """The first of `names` the text model's fields set to an int > 0."""
        for n in names:
            v = _int(self.text.get(n))
            if v is not None and v > 0:
                return v
        return default


def config_file(path) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def parse(raw: dict, path: str = "") -> HubConfig:
    """A config.json's dict -> HubConfig (the text model found under text_config when there is one)."""
    archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    top = next((a for a in archs if isinstance(a, str)), None)
    nested = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None
    if nested is None or (_int(raw.get("num_hidden_layers")) and _int(raw.get("hidden_size"))
                          and top not in WRAPPERS):
        return HubConfig(path, raw, raw, top, top, None)
    t_archs = nested.get("architectures") if isinstance(nested.get("architectures"), list) else []
    text_arch = next((a for a in t_archs if isinstance(a, str)), None) \
        or TEXT_ARCH_OF_TYPE.get(str(nested.get("model_type"))) or WRAPPERS.get(top or "")
    return HubConfig(path, raw, nested, top or text_arch, text_arch, top)


def read_config(path, flag: str = "--config") -> HubConfig:
    """The config.json at `path` (a file or its folder), or UsageError in one line: what is wrong, what to do."""
    p = config_file(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e}); give a HF config.json or its "
                         f"folder") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{flag} {path}: cannot read a JSON config ({e}); give a HF config.json") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{flag} {path}: not a JSON object; expected a HF config.json")
    return parse(raw, str(path))


# the keys only an EAGLE draft's config carries (the engines' EAGLE workers read them off the draft's config)
DRAFT_KEYS = ("eagle_config", "eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states", "draft_vocab_size")


def draft_sign(raw: dict) -> Optional[str]:
    """What marks a config.json's dict as an EAGLE draft's: its Eagle class (LlamaForCausalLMEagle3) or a key
    only a draft carries; None for a target model's config."""
    archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    cls = next((a for a in archs if isinstance(a, str) and "eagle" in a.lower()), None)
    if cls is not None:
        return cls
    key = next((k for k in DRAFT_KEYS if k in raw), None)
    return f"its {key}" if key else None


PROBE_INSTEAD = ("probe the target's config.json; a draft's config goes to `tpprobe layers --draft-config`, "
                 "`tpprobe fix --draft` and `tpprobe accept --draft`")


def check_target(path, flag: str = "--config", instead: str = PROBE_INSTEAD) -> None:
    """UsageError (one line) when the config at `path` is an EAGLE draft's, where a target model's is asked for
    (`flag`; `instead`: what to pass instead); an unreadable file passes (its reader says what is wrong with it)."""
    hub = try_read(path)
    sign = draft_sign(hub.raw) if hub is not None else None
    if sign is None:
        return
    kind = "EAGLE" if not sign.startswith("its ") and "eagle3" not in sign.lower() else "EAGLE-3"
    raise UsageError(f"{flag} {path} is an {kind} draft's config ({sign}), not a target model's: {instead}")


def try_read(path) -> Optional[HubConfig]:
    """read_config, or None for a file that cannot be read (the caller says so where it matters)."""
    try:
        return read_config(path)
    except UsageError:
        return None
