"""The SGLang plugin's settings, declared once: environment variables read in every SGLang process
(`PluginOptions.from_env`), with the flag and help each one documents. The vLLM plugin reads the same.

A value a plugin cannot read (`TPPROBE_MAX_STEPS=abc`, `TPPROBE_MAX_BYTES=1GB`, an unknown forward mode, ...)
is never the engine's problem: `plugin_settings` says ONE line (the variable, its value, what it takes, that
the plugin is off for this server) and the plugin stays off, since what the user meant is unknown."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

from tpprobe.config.fields import opt
from tpprobe.core.errors import UsageError

DEFAULT_TARGETS = (
    "sglang.srt.models.llama.LlamaForCausalLM.forward",
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.forward",
    # Kimi-K2.5 (hub architecture): the wrapper's forward embeds the prompt (general_mm_embed_routine) and
    # hands its DeepseekV3 `language_model` the embeddings (`input_embeds`); wrapped here so the embedding
    # is seen, the language model's own forward then runs inside it unwrapped (plugin.py: one capture a forward)
    "sglang.srt.models.kimi_k25.KimiK25ForConditionalGeneration.forward",
)


def _every(text: str) -> int:
    from tpprobe.engines.watch import EVERY_TAKES, read_every
    n = read_every(text)
    if n is None:
        raise ValueError(f"not a number of forwards (it takes {EVERY_TAKES})")
    return n


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _whole(what: str) -> Callable[[str], int]:
    """A parser of a whole number >= 0 (`what` it counts, for the line that refuses anything else)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"not a whole number >= 0 (it takes {what})")
        return n
    return parse


def _nbytes(text: str) -> int:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not math.isfinite(x) or x < 0:
        raise ValueError("not a number of bytes >= 0 (it takes a plain number, e.g. 2e9 or 500000000; no unit)")
    return int(x)


@dataclass
class PluginOptions:
    dir: Optional[Path] = opt("--out", None, "folder to write to (required to enable anything)",
                              env="TPPROBE_CAPTURE_DIR", parse=Path)
    max_steps: int = opt("--max-steps", 1, "forwards to capture per rank, counted over the selected modes; "
                         "step N goes to DIR/dp{D}-pp{P}/step-{N:06d}-{mode}", env="TPPROBE_MAX_STEPS",
                         parse=_whole("the number of forwards to capture per rank, e.g. 8"))
    modes: set = opt("--modes", "extend", "comma list of ForwardMode names to capture (\"all\": every mode)",
                     env="TPPROBE_FORWARD_MODES", parse=lambda s: {m.lower() for m in _csv(s)})
    keep: list = opt("--keep", "", "comma list of point-name patterns kept as FULL tensors (default: none, every "
                     "point is a fingerprint of a few KB; \"*\" keeps every point)", env="TPPROBE_KEEP", parse=_csv)
    keep_tokens: Optional[int] = opt("--keep-tokens", "", "keep at most this many token rows of each kept tensor "
                                     "(default: all)", env="TPPROBE_KEEP_TOKENS",
                                     parse=lambda s: _whole("the number of token rows kept of each kept tensor, "
                                                            "e.g. 16")(s) if s else None)
    max_bytes: int = opt("--max-bytes", 2e9, "byte budget for kept tensors per rank over the run, checked BEFORE "
                         "each copy (a tensor that does not fit is fingerprinted, not copied)",
                         env="TPPROBE_MAX_BYTES", parse=_nbytes)
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
    def from_env(cls, environ=None, modes: Optional[dict] = None) -> Optional["PluginOptions"]:
        """None unless TPPROBE_CAPTURE_DIR is set (then nothing else happens). A variable set but empty is its
        default. A value that cannot be read raises UsageError, one line naming the variable, its value and what
        it takes; `modes` (the engine's forward modes: name -> meaning, `ALIASES` its other words for them) makes
        an unknown TPPROBE_FORWARD_MODES entry one too (None: not checked, SGLang's ForwardMode names)."""
        environ = os.environ if environ is None else environ
        kw = {}
        for f in fields(cls):
            env = f.metadata["env"]
            raw = environ.get(env) or None
            if f.name == "dir" and not raw:
                return None
            try:
                kw[f.name] = f.metadata["parse"](raw if raw is not None else str(f.default))
            except ValueError as e:
                raise UsageError(f"{env}={raw!r}: {e}") from None
        if modes is not None and (why := unknown_modes(kw["modes"], modes)):
            raise UsageError(f"TPPROBE_FORWARD_MODES={environ.get('TPPROBE_FORWARD_MODES')!r}: {why}")
        if kw.get("watch") and not environ.get("TPPROBE_MAX_STEPS"):
            kw["max_steps"] = 0          # watching: no capture window besides, unless asked for
        return cls(**kw)

    @classmethod
    def env_help(cls) -> str:
        return "\n".join(f"  {f.metadata['env']:<24} {f.metadata['help']}" for f in fields(cls))


# other engines' words for tpprobe's forward modes: a user who writes one is told which mode means it
ALIASES = {"prefill": "extend", "mixed": "extend", "chunked_prefill": "extend", "verify": "decode",
           "target_verify": "decode"}


def unknown_modes(picked, modes: dict) -> str:
    """'' when every mode in `picked` is one of `modes` (name -> meaning) or "all"; else what is wrong, with the
    modes that exist and, for another engine's word (`ALIASES`), the mode that means it."""
    bad = [m for m in sorted(picked) if m != "all" and m not in modes]
    if not bad and picked:
        return ""
    if not picked:
        return "names no forward mode"
    hints = [f"for {m!r} write {ALIASES[m]}" for m in bad if ALIASES.get(m) in modes]
    listed = ", ".join(f"{k} ({v})" for k, v in modes.items())
    return (f"no forward mode {', '.join(repr(m) for m in bad)}; tpprobe's modes here are {listed} and all"
            + (f": {', '.join(hints)}" if hints else ""))


# the line a refused setting gets is said once per server: the process that says it first (the one that
# builds the engine) leaves it in TPPROBE_SETTINGS_REFUSED, which every process it starts inherits
REFUSED = "TPPROBE_SETTINGS_REFUSED"


def plugin_settings(engine: str, modes: Optional[dict] = None, say: Optional[Callable[[str], None]] = None
                    ) -> Optional[dict]:
    """The plugin's settings as a dict, None when it is off: TPPROBE_CAPTURE_DIR unset, or any setting it
    reads refused (then ONE line says which, its value, what it takes and that the plugin is off for this
    server; never an exception: vLLM and SGLang run their plugins where an exception stops the engine or is
    a traceback). Besides the PluginOptions: the numeric diagnosis knobs the plugins read (tpprobe/config/
    knobs.py), TPPROBE_ID_RULE and TPPROBE_DRAFT_TRAINED's grammar."""
    try:
        opts = PluginOptions.from_env(modes=modes)
        if opts is None:
            return None
        from tpprobe.config.knobs import check_numeric_knobs
        from tpprobe.engines.capture_rule import env_id_rule
        from tpprobe.engines.draft_training import from_env as draft_trained

        check_numeric_knobs(reader="plugin")
        env_id_rule()
        draft_trained()
    except Exception as e:  # noqa: BLE001 - a setting never stops the engine: the plugin stays off
        why = str(e) if isinstance(e, UsageError) else f"settings unreadable: {type(e).__name__}: {e}"
        line = (f"{why}; the tpprobe {engine} plugin is OFF for this server (nothing is captured or watched): "
                f"set it right and restart the server")
        if os.environ.get(REFUSED) != line:      # said here first, or a setting another than the parent's
            os.environ[REFUSED] = line
            (say or _say)(line)
        return None
    return vars(opts)


def _say(msg: str) -> None:
    import sys
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)
