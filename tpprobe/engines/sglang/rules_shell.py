"""The shell SGLang's EAGLE-3 setter runs on: a model class's object built without `__init__`.

`build_shell(cls, L)` holds only what `set_eagle3_layers_to_capture` reads (`config.num_hidden_layers`,
`pp_group.is_last_rank`, `model.layers`, the inner model or language model the class builds in its own
`__init__`, found in SGLang's source by `_inner_class`); `layer_owner` finds what the setter marked.
Used by tpprobe.engines.sglang.rules `derive`.
"""
from __future__ import annotations

import importlib
import inspect
import re
from types import SimpleNamespace
from typing import Optional

# process-wide by nature: the installed sglang's source text, which does not change while it runs
_SOURCES: dict = {}


def source_of(obj) -> str:
    """inspect.getsource, once per object (derive reads the same methods for every id)."""
    try:
        return _SOURCES[obj]
    except (KeyError, TypeError):
        pass
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):
        text = ""
    try:
        _SOURCES[obj] = text
    except TypeError:
        pass
    return text


def _inner_class(cls: type, attr: str) -> Optional[type]:
    """The class `cls.__init__` assigns to self.<attr> (SGLang's own source, resolved in its module)."""
    pat = re.compile(rf"self\.{attr}\s*=\s*((?:self\.)?[A-Za-z_][\w\.]*)\(")
    mro = [c for c in cls.__mro__ if c.__module__.startswith("sglang.")]
    for c in mro:
        init = vars(c).get("__init__")
        if init is None:
            continue
        g = vars(importlib.import_module(c.__module__))
        for m in pat.finditer(source_of(init)):
            name = m.group(1)
            if name.startswith("self."):            # self.body_cls(...): a class attribute
                v = getattr(cls, name[5:], None)
                if isinstance(v, type):
                    return v
                continue
            if isinstance(g.get(name), type):
                return g[name]
            imp = re.search(rf"from ([\w\.]+) import [^\n]*\b{name}\b", source_of(init))
            if imp:                                 # imported inside __init__
                try:
                    v = getattr(importlib.import_module(imp.group(1)), name, None)
                except Exception:  # noqa: BLE001
                    v = None
                if isinstance(v, type):
                    return v
            # a parameter (language_model_cls=...): the most derived class passing it wins
            for d in mro:
                hit = re.search(rf"\b{name}\s*=\s*(\w+)", source_of(vars(d).get("__init__", "")))
                if hit:
                    gd = vars(importlib.import_module(d.__module__))
                    if isinstance(gd.get(hit.group(1)), type):
                        return gd[hit.group(1)]
    return None


class _Layer(SimpleNamespace):
    pass


def build_shell(cls: type, L: int, depth: int = 0):
    import torch

    text = SimpleNamespace(num_hidden_layers=L)
    cfg = SimpleNamespace(num_hidden_layers=L, text_config=text, get_text_config=lambda: text)
    # class attributes, so they shadow SGLang's properties (pp_group reads the parallel state)
    fixed = {"config": cfg, "pp_group": SimpleNamespace(is_last_rank=True, is_first_rank=True),
             "start_layer": 0, "end_layer": L}
    shell_cls = type(cls.__name__, (cls,), {**fixed, "__module__": cls.__module__})
    obj = shell_cls.__new__(shell_cls)
    if isinstance(obj, torch.nn.Module):
        torch.nn.Module.__init__(obj)
    obj.__dict__["layers"] = [_Layer() for _ in range(L)]
    obj.__dict__["capture_aux_hidden_states"] = False
    if depth < 3:
        for attr in ("model", "language_model"):
            inner = _inner_class(cls, attr)
            sub = build_shell(inner, L, depth + 1) if inner is not None else _bag(L)
            obj.__dict__[attr] = sub        # plain attributes: no module registration needed
    return obj


class _Bag(SimpleNamespace):
    """What the shell holds for an inner model whose class is not found in SGLang's Python."""


def _bag(L: int):
    return _Bag(layers=[_Layer() for _ in range(L)], start_layer=0, end_layer=L)


def is_bag(obj) -> bool:
    return type(obj) is _Bag


def layer_owner(obj, depth: int = 0):
    """The object that owns the decoder layers the setter marked: (object, path)."""
    d = getattr(obj, "__dict__", {})
    if "layers_to_capture" in d or any(getattr(x, "_is_layer_to_capture", False) for x in d.get("layers", [])):
        return obj, ""
    if depth < 3:
        for attr in ("model", "language_model"):
            if attr in d:
                o, p = layer_owner(d[attr], depth + 1)
                if o is not None:
                    return o, f"{attr}." + p
    return None, ""
