"""The SGLang plugin's settings, declared once: environment variables read in every SGLang process
(`PluginOptions.from_env`), with the flag and help each one documents."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from tpprobe.config.fields import opt

DEFAULT_TARGETS = (
    "sglang.srt.models.llama.LlamaForCausalLM.forward",
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.forward",
    # Kimi-K2.5 (hub architecture): the wrapper's forward embeds the prompt (general_mm_embed_routine) and
    # hands its DeepseekV3 `language_model` the embeddings (`input_embeds`); wrapped here so the embedding
    # is seen, the language model's own forward then runs inside it unwrapped (plugin.py: one capture a forward)
    "sglang.srt.models.kimi_k25.KimiK25ForConditionalGeneration.forward",
)


def _every(text: str) -> int:
    from tpprobe.engines.watch import parse_every
    return parse_every(text)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@dataclass
class PluginOptions:
    dir: Optional[Path] = opt("--out", None, "folder to write to (required to enable anything)",
                              env="TPPROBE_CAPTURE_DIR", parse=Path)
    max_steps: int = opt("--max-steps", 1, "forwards to capture per rank, counted over the selected modes; "
                         "step N goes to DIR/dp{D}-pp{P}/step-{N:06d}-{mode}", env="TPPROBE_MAX_STEPS", parse=int)
    modes: set = opt("--modes", "extend", "comma list of ForwardMode names to capture (\"all\": every mode)",
                     env="TPPROBE_FORWARD_MODES", parse=lambda s: {m.lower() for m in _csv(s)})
    keep: list = opt("--keep", "", "comma list of point-name patterns kept as FULL tensors (default: none, every "
                     "point is a fingerprint of a few KB; \"*\" keeps every point)", env="TPPROBE_KEEP", parse=_csv)
    keep_tokens: Optional[int] = opt("--keep-tokens", "", "keep at most this many token rows of each kept tensor "
                                     "(default: all)", env="TPPROBE_KEEP_TOKENS",
                                     parse=lambda s: int(s) if s else None)
    max_bytes: int = opt("--max-bytes", 2e9, "byte budget for kept tensors per rank over the run, checked BEFORE "
                         "each copy (a tensor that does not fit is fingerprinted, not copied)",
                         env="TPPROBE_MAX_BYTES", parse=lambda s: int(float(s)))
    embed: Optional[str] = opt("--embed", "", "the embedding's module path or class glob (default: found from "
                               "structure, the module that takes the input ids and returns [tokens, hidden])",
                               env="TPPROBE_EMBED", parse=lambda s: s or None)
    layer_list: Optional[str] = opt("--layer-list", "", "the decoder layers' ModuleList path or class glob "
                                    "(default: the longest list)", env="TPPROBE_LAYER_LIST",
                                    parse=lambda s: s or None)
    watch: int = opt("--watch", 0, "check one forward in N on every TP rank for as long as the engine serves (0: off; "
                     "\"on\": the default N; docs/watch.md); with it TPPROBE_MAX_STEPS defaults to 0",
                     env="TPPROBE_WATCH", parse=lambda s: _every(s))
    targets: list = opt("--models", "", "comma list of dotted `Class.forward` targets to wrap (default: SGLang's "
                        "LlamaForCausalLM, DeepseekV2ForCausalLM (DeepseekV3 inherits it) and "
                        "KimiK25ForConditionalGeneration)",
                        env="TPPROBE_SGLANG_MODELS", parse=lambda s: _csv(s) or list(DEFAULT_TARGETS))

    @classmethod
    def from_env(cls, environ=None) -> Optional["PluginOptions"]:
        """None unless TPPROBE_CAPTURE_DIR is set (then nothing else happens)."""
        environ = os.environ if environ is None else environ
        kw = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if f.name == "dir" and not raw:
                return None
            kw[f.name] = f.metadata["parse"](raw if raw is not None else str(f.default))
        if kw.get("watch") and environ.get("TPPROBE_MAX_STEPS") is None:
            kw["max_steps"] = 0          # watching: no capture window besides, unless asked for
        return cls(**kw)

    @classmethod
    def env_help(cls) -> str:
        return "\n".join(f"  {f.metadata['env']:<24} {f.metadata['help']}" for f in fields(cls))
