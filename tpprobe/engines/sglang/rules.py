"""Every SGLang architecture's EAGLE-3 capture rule, derived from the installed SGLang's own code.

`derive(name, ids, num_layers)` imports the one SGLang model module that defines the architecture,
builds a *shell* of its `*ForCausalLM` class (the object without `__init__`: no weights, no
parallel state, no device) holding only what the setter reads (`config.num_hidden_layers`,
`pp_group.is_last_rank`, `model.layers`, the inner model or language model the class builds in
its own `__init__`), and runs SGLang's own `set_eagle3_layers_to_capture(ids)` on it. What the
setter leaves behind is the capture rule, as SGLang will apply it:

* `layers_to_capture` on the object that owns the decoder layers (the +1, the DeepSeek "+1 only
  when the first id is 1", gpt_oss's "ids as given when one of them is L", minimax_m3_vl's shifted
  default: whatever that SGLang version does);
* `_is_layer_to_capture` flags on layers (the Qwen-MoE family marks `self.layers[id]`: an id of L
  raises IndexError there and -1 flags the *last* layer through Python's negative index);
* an exception raised by the setter itself (a crash at server start).

The capture condition of the forward loop is read from the class's own `forward` source (the
only thing not executed): whether the loop tests the per-layer flag or `i in layers_to_capture`,
whether the output of the last layer (point L) is captured after the loop (gemma4, gpt_oss,
minimax_m3), and whether captures go into an `AuxHiddenStatePacker` that raises `captured n of
K aux hidden states` when one is missing (DeepSeek family). Loop point i is the residual stream
entering layer i = HF hidden_states[i] (0 = the embedding output).

When SGLang cannot be imported, `tpprobe.engines.sglang.layer_ids` falls back to its pinned table.
The shell is built in rules_shell.py; the table this module generates is replayed by rules_replay.py.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import re
import warnings
from types import SimpleNamespace
from typing import Optional

from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang.rules_replay import ALIASES, MAPS, STORES, TABLE_MODULE, Derived, derive_from_table
from tpprobe.engines.sglang.rules_shell import build_shell, is_bag, layer_owner, source_of

SETTER = "set_eagle3_layers_to_capture"


def models_dir() -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "srt", "models")


@functools.lru_cache(maxsize=1)    # process-wide by nature: the installed SGLang's files, unchanged while it runs
def setter_files() -> tuple[str, ...]:
    """SGLang model files (module names) that define the EAGLE-3 setter (read as text, no import)."""
    d = models_dir()
    out = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".py"):
            with open(os.path.join(d, f), encoding="utf-8") as fh:
                if f"def {SETTER}" in fh.read():
                    out.append(f[:-3])
    return tuple(out)


@functools.lru_cache(maxsize=1)    # process-wide by nature, as setter_files
def _class_files() -> dict[str, str]:
    """class name -> model file, for every class defined in sglang/srt/models (text scan)."""
    d = models_dir()
    out: dict[str, str] = {}
    pat = re.compile(r"^class (\w+)\(", re.M)
    for f in sorted(os.listdir(d)):
        if f.endswith(".py"):
            with open(os.path.join(d, f), encoding="utf-8") as fh:
                for m in pat.finditer(fh.read()):
                    out.setdefault(m.group(1), f[:-3])
    return out


def _import(module: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tpprobe.engines.sglang import cpu_mode

        cpu_mode.quiet_import_noise()
        cpu_mode.install_torchvision_shim()
        return importlib.import_module(f"sglang.srt.models.{module}")


def _entry_classes(mod) -> list[type]:
    e = getattr(mod, "EntryClass", None)
    if e is None:
        return []
    return list(e) if isinstance(e, (list, tuple)) else [e]


def resolve(name: str) -> type:
    """An architecture name -> SGLang's model class. Accepted: the HF architecture / SGLang class
    (Qwen3MoeForCausalLM), SGLang's model file (qwen3_moe), a HF model_type (deepseek_v3) and a
    few common aliases (kimi, kimi_k2). UsageError when it has no EAGLE-3 capture."""
    raw = name.strip()
    key = ALIASES.get(raw.lower(), raw)
    files = _class_files()
    cls_name, module = None, None
    if key in files:                                   # a class name
        cls_name, module = key, files[key]
    else:
        low = key.lower().replace("-", "_")
        if os.path.exists(os.path.join(models_dir(), f"{low}.py")):
            module = low
        else:                                          # a HF model_type
            cls_name = _hf_causal_lm(low)
            module = files.get(cls_name) if cls_name else None
    if module is None:
        raise UsageError(f"unknown SGLang arch {name!r}: give an architecture from config.json "
                         f"(e.g. Qwen3MoeForCausalLM), an SGLang model file or a model_type; "
                         f"EAGLE-3 capture is defined in {', '.join(setter_files())}")
    try:
        mod = _import(module)
    except Exception as e:  # noqa: BLE001 - an SGLang model file that cannot load here
        raise UsageError(f"--arch {name}: SGLang's model file {module}.py does not import here "
                         f"({type(e).__name__}: {e})") from None
    if cls_name is None:
        cands = [c for c in _entry_classes(mod) if hasattr(c, SETTER)]
        if not cands:
            cands = [c for c in vars(mod).values() if isinstance(c, type) and SETTER in vars(c)
                     and c.__module__ == mod.__name__ and "Model" != c.__name__[-5:]]
        if not cands:
            raise UsageError(f"--arch {name}: SGLang's {module}.py has no model with EAGLE-3 capture")
        return cands[0]
    cls = getattr(mod, cls_name)
    if not hasattr(cls, SETTER):
        raise UsageError(f"--arch {name}: SGLang's {cls_name} ({module}.py) has no EAGLE-3 capture "
                         f"({SETTER}); the architectures with one are in {', '.join(setter_files())}")
    return cls


def _hf_causal_lm(model_type: str) -> Optional[str]:
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    except Exception:  # noqa: BLE001
        return None
    for m in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if model_type in m:
            v = m[model_type]
            return v if isinstance(v, str) else v[0]
    return None


# ---- the rule -------------------------------------------------------------------------------
# process-wide by nature: the installed sglang's source lines, which do not change while it runs
_LINES: dict = {}


@contextlib.contextmanager
def _last_pp_rank():
    """Setters that read get_parallel().pp_group (exaone_moe, minimax_m2) see the last PP rank."""
    try:
        from sglang.srt.runtime_context import get_parallel

        cm = get_parallel().override(pp_group=SimpleNamespace(is_last_rank=True, is_first_rank=True))
    except Exception:  # noqa: BLE001 - an SGLang without the override: setters that need it raise
        cm = contextlib.nullcontext()
    with cm:
        yield


def derive(name_or_cls, ids: Optional[list[int]], num_layers: int) -> Derived:
    cls = resolve(name_or_cls) if isinstance(name_or_cls, str) else name_or_cls
    L = int(num_layers)
    setter = getattr(cls, SETTER)
    defining = next(c for c in cls.__mro__ if SETTER in vars(c))
    line = _LINES.get(setter)
    if line is None:
        try:
            line = _LINES[setter] = inspect.getsourcelines(setter)[1]
        except (OSError, TypeError):
            line = 0
    where = f"sglang/srt/models/{defining.__module__.rsplit('.', 1)[-1]}.py:{line}"
    shell = build_shell(cls, L)
    d = Derived(cls=defining.__name__, file=where, num_layers=L, ids=None if ids is None else list(ids),
                layers_to_capture=None)
    try:
        with _last_pp_rank():
            setter(shell, None if ids is None else list(ids))
    except AttributeError as e:
        held = [a for a in ("model", "language_model") if shell.__dict__.get(a) is getattr(e, "obj", None)]
        if held and is_bag(e.obj):
            # the setter calls a method of an inner object whose class is not in SGLang's Python (the shell
            # stands in for it with a bag): what that object captures cannot be read here; not SGLang's crash
            d.outside = (f"{defining.__name__}.{SETTER} ({where}) hands the ids to self.{held[0]}.{e.name}, "
                         f"an object {defining.__name__} builds outside SGLang's Python model classes: its rule "
                         f"cannot be read from SGLang's code")
        else:
            d.set_error = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - SGLang's own setter raised: that is the finding
        d.set_error = f"{type(e).__name__}: {e}"
    owner, path = layer_owner(shell)
    if owner is None:
        owner, path = (shell.__dict__.get("model") or shell), "model."
    d.owner = path.rstrip(".")
    ltc = getattr(owner, "__dict__", {}).get("layers_to_capture")
    d.layers_to_capture = None if ltc is None else [int(x) for x in ltc]
    layers = getattr(owner, "__dict__", {}).get("layers", [])
    d.flagged = [i for i, x in enumerate(layers) if getattr(x, "_is_layer_to_capture", False)]
    fcls = type(owner).__mro__[1] if not isinstance(owner, SimpleNamespace) else cls
    src = source_of(getattr(fcls, "forward", None))
    if "_is_layer_to_capture" not in src and "layers_to_capture" not in src:
        src = source_of(inspect.getmodule(fcls))          # the loop lives in a helper of that file
    d.forward_of = f"{fcls.__name__}.forward"
    d.loop_uses_flags = "_is_layer_to_capture" in src and not re.search(r"\bi\s+in\s+self\.layers_to_capture", src)
    d.captures_last = bool(re.search(r"(num_layers|self\.end_layer|len\(self\.layers\))\s+in\s+self\.layers_to_capture",
                                     src))
    d.packer = "AuxHiddenStatePacker(" in src
    return d


def all_architectures() -> list[tuple[str, type]]:
    """(file, class) for every SGLang architecture with EAGLE-3 capture (imports every model file
    that defines the setter; subclasses in other files are reached through their class names)."""
    out = []
    for f in setter_files():
        try:
            mod = _import(f)
        except Exception:  # noqa: BLE001
            continue
        for c in _entry_classes(mod):
            if hasattr(c, SETTER):
                out.append((f, c))
    return out


# ---- the table: the same rules as data, generated here (rules_replay.py replays it) ----------------
# `tabulate()` runs `derive` on every architecture over a grid of (ids, num_layers) and names, for each,
# the rule among a few that reproduces every result exactly (what the setter stores, what it flags,
# what it raises); `render_table` writes that as tpprobe/engines/sglang/rules_table.py.
def resolve_quiet(name: str):
    try:
        return resolve(name)
    except Exception:  # noqa: BLE001
        return None


def probe_grid(Ls=(1, 2, 3, 4, 5, 6, 8, 61)):
    for L in Ls:
        for ids in (None, [], [1], [0], [-1], [-2], [1, 2, 3], [-1, 1, 3], [0, 2, 4], [2, 1], [1, 1], [L - 1],
                    [L], [L + 1], [-L], [-L - 1], [0, L], [1, L], [L - 2, L], [L - 4, L // 2, 1], [1, L - 1]):
            yield ids, L


def _fields(d: Derived) -> tuple:
    return (d.cls, d.file, d.num_layers, d.ids, d.layers_to_capture, d.flagged, d.set_error, d.outside, d.owner,
            d.loop_uses_flags, d.captures_last, d.packer, d.forward_of)


def _rule_for(cls: type) -> dict:
    """The table entry reproducing `derive(cls, ...)` on every point of the grid (UsageError if none)."""
    grid = list(probe_grid())
    got = [derive(cls, ids, L) for ids, L in grid]
    first = got[0]
    base = {"cls": first.cls, "file": first.file, "loop_uses_flags": first.loop_uses_flags,
            "captures_last": first.captures_last, "packer": first.packer, "forward_of": first.forward_of}
    owners = {d.owner for d in got if d.layers_to_capture is not None} or {first.owner}
    errs = {d.owner for d in got if d.layers_to_capture is None}
    if len(owners) == 1:
        base["owner"] = owners.pop()
        if errs and errs != {base["owner"]}:
            base["owner_on_error"] = errs.pop()
    cands = []
    if all(d.outside for d in got) and len({d.outside for d in got}) == 1:
        cands.append({**base, "outside": first.outside})
    if all(d.layers_to_capture is None and d.set_error for d in got) and len({d.set_error for d in got}) == 1:
        cands.append({**base, "raises": first.set_error})
    cands += [{**base, "default_shift": ds, "map": m, "store": s} for ds in (0, 1, None) for m in MAPS for s in STORES]
    tab = {"SGLANG_VERSION": "", "CLASSES": {"X": None}, "FILES": {}, "MODEL_TYPES": {}, "ARCHITECTURES": []}
    for c in cands:
        if "owner" not in c:
            break
        tab["CLASSES"]["X"] = c
        if all(_fields(derive_from_table("X", ids, L, tab)) == _fields(d) for (ids, L), d in zip(grid, got)):
            return c
    raise UsageError(f"{cls.__name__}: no tabulated rule reproduces SGLang's set_eagle3_layers_to_capture "
                     f"({first.file}); extend tpprobe.engines.sglang.rules_replay.MAPS/STORES")


def tabulate() -> dict:
    """The table, from the installed SGLang (imports every model file with EAGLE-3 capture)."""
    from tpprobe.engines.sglang import SGLANG_VERSION

    archs = all_architectures()
    classes: dict[str, dict] = {}
    rows = []
    for f, cls in archs:
        # a name is the class SGLang's lookup finds (resolve); an entry class of another file that
        # shares the name (Qwen3_5ForCausalLM in qwen3_5 and qwen3_5_text) is kept as "file.Name"
        key = cls.__name__ if resolve(cls.__name__) is cls else f"{f}.{cls.__name__}"
        if key not in classes:
            classes[key] = _rule_for(cls)
        if cls.__name__ not in classes:
            classes[cls.__name__] = _rule_for(resolve(cls.__name__))
        rows.append([f, cls.__name__, key])
    files = _class_files()
    for name, f in sorted(files.items()):           # subclasses in other files (MistralForCausalLM, ...)
        if name in classes:
            continue
        mod = importlib.sys.modules.get(f"sglang.srt.models.{f}")
        if mod is None or getattr(mod, name, None) is not resolve_quiet(name):
            continue
        try:
            c = getattr(mod, name, None) if mod is not None else None
            if not (isinstance(c, type) and c.__module__ == mod.__name__ and hasattr(c, SETTER)):
                continue
            classes[name] = _rule_for(c)
        except Exception:  # noqa: BLE001 - a stub class, or a shell this class cannot be built on
            continue
    by_file = {}
    for f in sorted({f for f in files.values()}):
        mod = importlib.sys.modules.get(f"sglang.srt.models.{f}")
        if mod is None:
            continue
        cands = [c for c in _entry_classes(mod) if hasattr(c, SETTER)]
        if not cands:
            cands = [c for c in vars(mod).values() if isinstance(c, type) and SETTER in vars(c)
                     and c.__module__ == mod.__name__ and "Model" != c.__name__[-5:]]
        if cands and cands[0].__name__ in classes:
            by_file[f] = cands[0].__name__
    model_types = {}
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
        mts = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
    except Exception:  # noqa: BLE001
        mts = []
    for mt in mts:
        low = mt.lower().replace("-", "_")
        if low in by_file or os.path.exists(os.path.join(models_dir(), f"{low}.py")):
            continue
        c = _hf_causal_lm(low)
        if c in classes:
            model_types[low] = c
    return {"SGLANG_VERSION": SGLANG_VERSION, "CLASSES": dict(sorted(classes.items())), "FILES": by_file,
            "MODEL_TYPES": model_types, "ARCHITECTURES": rows}


def render_table(tab: dict) -> str:
    import pprint

    head = (f'"""SGLang {tab["SGLANG_VERSION"]}\'s EAGLE-3 capture rules, one entry per architecture: GENERATED by\n'
            f'`python -m tpprobe.engines.sglang.rules --write` from that SGLang\'s own code '
            f'(tpprobe.engines.sglang.rules.tabulate);\n'
            f'tests/engines/sglang/test_layers_table.py regenerates it from the installed SGLang and asserts it '
            f'equals this file.\n'
            f'Read by `tpprobe layers` (and the probe report) without importing SGLang."""\n')
    body = "".join(f"{k} = {pprint.pformat(tab[k], width=110, sort_dicts=False)}\n\n"
                   for k in ("SGLANG_VERSION", "CLASSES", "FILES", "MODEL_TYPES", "ARCHITECTURES"))
    return head + "\n" + body.rstrip() + "\n"


if __name__ == "__main__":   # python -m tpprobe.engines.sglang.rules --write: regenerate the table
    import sys

    text = render_table(tabulate())
    if "--write" in sys.argv:
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
        with open(os.path.join(root, TABLE_MODULE), "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
