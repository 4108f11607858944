"""SGLang's EAGLE-3 capture rules replayed from the shipped table (rules_table.py) without SGLang.

`derive_from_table(name, ids, num_layers)` answers what tpprobe.engines.sglang.rules `derive` answers
by running SGLang's own setter, from the table that module generates; `use_table()` says which of the
two answers on this machine. `Derived` is the one record both return.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tpprobe.core.errors import UsageError

# names people use that are neither an SGLang model file, nor its class, nor a HF model_type
ALIASES = {
    "kimi": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi-k2": "DeepseekV3ForCausalLM", "deepseek": "DeepseekV3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration", "kimi-k2.5": "KimiK25ForConditionalGeneration",
    "mistral": "MistralForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM", "minimax_m3": "MiniMaxM3SparseForCausalLM",
}


@dataclass
class Derived:
    cls: str                       # SGLang class the setter belongs to
    file: str                      # sglang/srt/models/<file>.py:<line> of the setter
    num_layers: int
    ids: Optional[list[int]]
    layers_to_capture: Optional[list[int]]   # as the setter stored it (None: flags only / raised)
    flagged: list[int] = field(default_factory=list)   # layers whose _is_layer_to_capture is set
    set_error: Optional[str] = None          # the setter raised
    outside: Optional[str] = None            # the setter hands the ids to an object outside SGLang's code
    owner: str = ""                          # attribute path of the object holding the layers
    loop_uses_flags: bool = False            # the capture condition is the per-layer flag
    captures_last: bool = False              # point L (the last layer's output) is captured
    packer: bool = False                     # AuxHiddenStatePacker: a missing capture raises
    forward_of: str = ""                     # whose forward was read

    @property
    def captured(self) -> list[int]:
        """Capture points (0..L) the forward reaches, ascending, each once."""
        if self.set_error or self.outside:
            return []
        L = self.num_layers
        if self.loop_uses_flags:
            pts = set(self.flagged)
        else:
            pts = {c for c in (self.layers_to_capture or []) if 0 <= c < L}
        if self.captures_last and L in (self.layers_to_capture or []):
            pts.add(L)
        return sorted(pts)


# ---- the table: the same rules as data, for a machine without SGLang (and fast with it) ------------
# rules.py `tabulate()` names, for each architecture, the rule among MAPS x STORES (or "raises") that
# reproduces SGLang's setter; `derive_from_table` replays a rule on any ids. tests/engines/sglang/test_layers_table.py
# regenerates the table from the installed SGLang and asserts it equals the shipped one, and that the
# replay equals `derive` on another grid.
TABLE_MODULE = "tpprobe/engines/sglang/rules_table.py"
MAPS = ("plus1", "plus1_if_first_is_1", "as_given_if_max_is_L", "as_given")
STORES = ("list", "flags", "list+flags_in_range")


def _map(kind: str, ids: list[int], L: int) -> list[int]:
    if kind == "plus1":
        return [i + 1 for i in ids]
    if kind == "plus1_if_first_is_1":          # DeepSeek-V2/V3, GLM-4-MoE-Lite
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    if kind == "as_given_if_max_is_L":         # gpt_oss: ids naming the final boundary are kept
        return list(ids) if ids and max(ids) == L else [i + 1 for i in ids]
    return list(ids)


def _replay(rule: dict, ids: Optional[list[int]], L: int) -> tuple[Optional[list[int]], list[int], Optional[str]]:
    """(layers_to_capture, flagged layers, the setter's error) as SGLang's setter leaves them."""
    if rule.get("raises"):
        return None, [], rule["raises"]
    if rule.get("outside"):
        return None, [], None
    if ids is None:
        d = rule["default_shift"]
        if d is None:       # no default: the setter iterates the ids it was given (an inner model's setter)
            return None, [], "TypeError: 'NoneType' object is not iterable"
        ltc = [2 + d, L // 2 + d, L - 3 + d]
    else:
        ltc = _map(rule["map"], list(ids), L)
    flagged: list[int] = []
    if rule["store"] == "flags":               # setattr(self.layers[i], ...) for each, in order
        for c in ltc:
            if not -L <= c < L:
                return ltc, sorted(set(flagged)), "IndexError: list index out of range"
            flagged.append(c % L)
    elif rule["store"] == "list+flags_in_range":
        flagged = [c for c in ltc if 0 <= c < L]
    return ltc, sorted(set(flagged)), None


def derive_from_table(name: str, ids: Optional[list[int]], num_layers: int, table=None) -> Derived:
    """`derive`, from the shipped table (no SGLang import)."""
    tab = table or _table()
    cls_name = resolve_in_table(name, tab)
    e = tab["CLASSES"][cls_name]
    L = int(num_layers)
    ltc, flagged, err = _replay(e, ids, L)
    owner = e["owner"] if ltc is not None else e.get("owner_on_error", e["owner"])
    return Derived(cls=e["cls"], file=e["file"], num_layers=L, ids=None if ids is None else list(ids),
                   layers_to_capture=ltc, flagged=flagged, set_error=err, outside=e.get("outside"), owner=owner,
                   loop_uses_flags=e["loop_uses_flags"], captures_last=e["captures_last"], packer=e["packer"],
                   forward_of=e["forward_of"])


def _table() -> dict:
    from tpprobe.engines.sglang import rules_table as t

    return {"SGLANG_VERSION": t.SGLANG_VERSION, "CLASSES": t.CLASSES, "FILES": t.FILES,
            "MODEL_TYPES": t.MODEL_TYPES, "ARCHITECTURES": t.ARCHITECTURES}


def resolve_in_table(name: str, tab=None) -> str:
    """`resolve` over the table: a class name, SGLang model file, HF model_type or alias -> class name."""
    tab = tab or _table()
    raw = name.strip()
    key = ALIASES.get(raw.lower(), raw)
    if key in tab["CLASSES"]:
        return key
    low = key.lower().replace("-", "_")
    for where in ("FILES", "MODEL_TYPES"):
        if low in tab[where]:
            return tab[where][low]
    raise UsageError(f"unknown SGLang arch {name!r}: give an architecture from config.json (e.g. "
                     f"Qwen3MoeForCausalLM), an SGLang model file or a model_type; SGLang {tab['SGLANG_VERSION']} "
                     f"has EAGLE-3 capture in {len(tab['ARCHITECTURES'])} architectures (`tpprobe layers --arch all` "
                     f"lists them)")


def table_rows() -> list[tuple[str, str, str]]:
    """(file, class, table key) of every architecture, as `all_architectures` lists them."""
    return [tuple(x) for x in _table()["ARCHITECTURES"]]


def installed_version() -> Optional[str]:
    """The installed SGLang's version from its metadata (no import); None when not installed."""
    from tpprobe.engines.sglang import available

    if not available():
        return None
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - sglang on the path without metadata: read its code
        return "unknown"


def use_table() -> bool:
    """The table answers unless an SGLang of another release is installed (then its own code does)."""
    from tpprobe.engines.sglang import rules_table

    v = installed_version()
    return v is None or v == rules_table.SGLANG_VERSION
