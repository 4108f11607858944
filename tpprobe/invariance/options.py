"""`tpprobe invariance`'s options, declared once (as tpprobe/config/options.py declares the probe's).

Each field carries its flag, help text and how it reads from / writes to the command line: the
typer signature (`cli/__init__.py`) and the argv the ranks of one TP size run (`to_argv`) come from here.
`probe` is not an option: the model and run settings as the probe's own `ProbeOptions`, built
from these fields (`probe_options`), which building the model and the report read.

Torch-free on purpose: `tpprobe --help` imports this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import UsageError
from ..config.options import BUILTIN, ProbeOptions, backend_alias, cli_fields
from ..config.fields import opt

# the rank side's own flags: set by the parent for one TP size, never by a user
HIDDEN = frozenset(("part", "sites"))
# the fields that shape the model and the run: the probe's options of the same name
PROBE_FIELDS = ("model", "engine", "backend", "arch", "config", "num_layers", "hidden", "heads", "ffn", "vocab",
                "tokens", "seed", "dtype", "out", "timeout", "json_out", "html", "markdown", "quiet", "debug")


def cname(c) -> str:
    return f"tp{c[0]}·b{c[1]}"


def parse_sizes(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,2,4")
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,2,4")
    if len(set(vals)) != len(vals):
        raise UsageError(f"{flag} {text!r} repeats a value: give each size once")
    return sorted(vals)


def parse_reference(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    m = re.fullmatch(r"\s*tp\s*(\d+)\s*[,·x/ ]\s*b\s*(\d+)\s*", text)
    if not m:
        raise UsageError(f"--reference {text!r}: expected tpN,bM, e.g. tp1,b1 (TP size 1, batch 1)")
    return int(m.group(1)), int(m.group(2))


def _csv(v) -> str:
    return ",".join(map(str, v))


def _sites(text: Optional[str]) -> list[str]:
    return [x for x in (text or "").split(",") if x]


@dataclass
class InvarianceOptions:
    tp: list[int] = opt("--tp", [1, 2], "TP sizes to compare, e.g. 1,2,4 (each its own group of ranks)",
                        cli_type=str, parse=lambda s: parse_sizes(s, "--tp"), show=_csv)
    batch: list[int] = opt("--batch", [1, 3, 8], "batch sizes: the prompt alone (1) and among other prompts",
                           cli_type=str, parse=lambda s: parse_sizes(s, "--batch"), show=_csv)
    # (tp, batch); default (smallest tp, smallest batch)
    reference: Optional[tuple[int, int]] = opt(
        "--reference", None, "the configuration compared against, e.g. tp1,b1 (default: smallest tp and batch)",
        cli_type=Optional[str], parse=parse_reference, show=lambda c: f"tp{c[0]},b{c[1]}")
    expect: str = opt("--expect", "bitwise", "bitwise | noise: what every configuration must be for exit 0")
    model: Optional[str] = opt("--model", None, "your own model: package.module:factory (its "
                               "ProbeTarget.forward_batch batches)")
    engine: str = opt("--engine", "builtin", "builtin (default) | sglang: the model compared (SGLang's model "
                      "classes)", cli_type=Optional[str], cli_default=None)
    backend: str = opt("--backend", "auto", "the communication backend: auto (nccl with GPUs, else gloo) | gloo | "
                       "nccl (sglang: the old spelling of --engine)")
    arch: str = opt("--arch", "llama", "with --engine sglang: llama | deepseek_v2")
    config: Optional[str] = opt("--config", None, "with --engine sglang: a real config.json (random weights)")
    reduce: str = opt("--reduce", "default", "built-in model: default (the backend's all-reduce) | ordered (TP- and "
                      "batch-invariant: fixed-order all-gather + tree sum, per-row matmuls)")
    switch_above: Optional[int] = opt("--switch-above", None, "with --reduce ordered: messages over this many bytes "
                                      "take the backend's all-reduce instead (a size-dependent path, injected)",
                                      cli_type=Optional[int])
    num_layers: int = opt("--num-layers", BUILTIN["num_layers"], "built-in model: decoder layers")
    hidden: int = opt("--hidden", BUILTIN["hidden"], "built-in model: hidden size")
    heads: int = opt("--heads", BUILTIN["heads"], "built-in model: attention heads (divisible by every --tp)")
    ffn: int = opt("--ffn", BUILTIN["ffn"], "built-in model: MLP width")
    vocab: int = opt("--vocab", BUILTIN["vocab"], "built-in model: vocabulary size")
    tokens: int = opt("--tokens", BUILTIN["tokens"], "the prompt's length; the other prompts are half to twice "
                      "as long")
    seed: int = opt("--seed", BUILTIN["seed"], "weights and prompts come from this seed")
    dtype: str = opt("--dtype", "float32", "float32 | bfloat16 | float16")
    keep: bool = opt("--keep", False, "also keep the prompt rows of every cell that is not bitwise (and the "
                     "reference's), with exact stats")
    out: Optional[str] = opt("--out", None, "output folder (default: a fresh folder under ./tpprobe-runs)")
    timeout: float = opt("--timeout", 60.0, "seconds any rank waits on another")
    json_out: bool = opt("--json", False, "print report.json instead of the table")
    html: Optional[str] = opt("--html", None, "also write a self-contained HTML report")
    markdown: Optional[str] = opt("--markdown", None, "also write a Markdown summary")
    quiet: bool = opt("--quiet", False, "print the verdict lines only")
    debug: bool = opt("--debug", False, "show tracebacks")
    # the rank side of one TP size (the launcher passes it)
    part: bool = opt("--part", False, "rank side of one TP size (internal)")
    # modules whose output stands for a collective: at tp 1 always recorded, at tp > 1 watched for the
    # gathers and reduce-scatters issued in them (the parent passes what the largest TP size issued)
    sites: list[str] = opt("--sites", [], "modules standing for collectives (internal)", cli_type=Optional[str],
                           parse=_sites, show=_csv, cli_default=None)
    probe: Any = None         # tpprobe.config.options.ProbeOptions: the model and run settings (None: from the fields)
    engine_from_backend: Optional[str] = None    # the engine given as `--backend sglang` (the CLI says so once)

    def __post_init__(self):
        if self.probe is None:
            self.probe = self.probe_options()

    def probe_options(self) -> ProbeOptions:
        """The model and run settings as the probe's options: a fingerprint exchange of one layer id."""
        kw = {n: getattr(self, n) for n in PROBE_FIELDS}
        return ProbeOptions(layers=[-1], exchange="fingerprint", **kw)

    @classmethod
    def from_cli(cls, **values) -> "InvarianceOptions":
        """From the typer command's keyword arguments (each text option parsed by its field)."""
        kw = {}
        for f in cli_fields(cls):
            v, parse = values.get(f.name), f.metadata["parse"]
            kw[f.name] = parse(v) if parse is not None else v
        kw["engine"] = kw.get("engine") or "builtin"
        kw["backend"] = kw.get("backend") or "auto"
        kw.update(backend_alias(kw["engine"], kw["backend"], values.get("engine") is not None))
        return cls(**kw)

    def to_argv(self, tp: int, out) -> list[str]:
        """The command line one TP size's ranks run (`python -m tpprobe invariance --part ...`), writing
        to `out`; what only the parent reads (the reference, --expect, the report's forms) stays here."""
        a = ["invariance"]
        for f in cli_fields(type(self)):
            v, flag, show = getattr(self, f.name), f.metadata["flag"], f.metadata["show"]
            if f.name == "tp":
                v = [tp]
            elif f.name == "out":
                v = str(out)
            elif f.name in ("part", "quiet"):
                v = True
            elif f.name in ("reference", "json_out", "html", "markdown", "expect"):
                continue                       # the parent's: it compares and reports
            if isinstance(v, bool):
                a += [flag] if v else []
            elif v is not None and v != []:
                a += [flag, show(v) if show else str(v)]
        return a

    @property
    def configs(self) -> list[tuple[int, int]]:
        return [(t, b) for t in self.tp for b in self.batch]

    @property
    def ref(self) -> tuple[int, int]:
        return self.reference or (min(self.tp), min(self.batch))


def validate(opts: InvarianceOptions) -> None:
    """Everything checkable before a process starts (raises UsageError)."""
    from ..engines.registry import engine_of
    from ..probe.prepare import validate as probe_validate
    p = opts.probe
    if opts.expect not in ("bitwise", "noise"):
        raise UsageError(f"unknown --expect {opts.expect!r}: use bitwise or noise")
    if opts.ref not in opts.configs:
        raise UsageError(f"--reference {cname(opts.ref)} is not in the grid (--tp {','.join(map(str, opts.tp))} "
                         f"--batch {','.join(map(str, opts.batch))}): add it to --tp/--batch or pick one inside")
    engine = engine_of(p)
    if not engine.invariance:
        raise UsageError(f"tpprobe invariance builds the built-in model, SGLang's (--engine sglang) or your --model, "
                         f"not {engine.title}'s: drop --engine {engine.name}")
    builtin = engine.builtin_shapes
    if (opts.reduce != "default" or opts.switch_above is not None) and not builtin:
        raise UsageError("--reduce / --switch-above choose the built-in model's reduction: drop them with "
                         "--model or --engine sglang")
    if opts.switch_above is not None and opts.reduce != "ordered":
        raise UsageError("--switch-above N makes the ordered reduction fall back to the backend's all-reduce above "
                         "N bytes: use it with --reduce ordered")
    if opts.switch_above is not None and opts.switch_above < 0:
        raise UsageError(f"--switch-above must be >= 0 bytes (got {opts.switch_above})")
    for t in opts.tp:
        probe_validate(p, t)
        if builtin:
            builtin_cfg(opts, p.layers).validate(t)
    if p.tokens < 1:
        raise UsageError(f"--tokens must be >= 1 (got {p.tokens})")
    if len(opts.configs) < 2:
        raise UsageError(f"nothing to compare: --tp {','.join(map(str, opts.tp))} --batch "
                         f"{','.join(map(str, opts.batch))} is one configuration; give two TP sizes or batch sizes")


def builtin_cfg(opts: InvarianceOptions, layer_ids):
    from ..engines.builtin.model import BuiltinConfig
    cfg = BuiltinConfig.from_options(opts.probe, layer_ids)
    cfg.reduce, cfg.switch_bytes = opts.reduce, opts.switch_above
    return cfg

