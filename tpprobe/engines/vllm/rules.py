"""Every vLLM architecture's EAGLE-3 capture rule, derived from the installed vLLM's own code.

`derive(cls)` reads what vLLM does with an aux layer id for one model class of vLLM's registry
(`vllm.model_executor.models.registry`, every class with `supports_eagle3`):

* the decoder that holds the layers (`self.model = X(...)` in the class's `__init__`, through its MRO)
  and the forward that captures (its own or a base's): which loop points it offers to
  `_maybe_add_hidden_state` or to an `in self.aux_hidden_state_layers` test (0 before the loop,
  i+1 after layer i, i before layer i, N after the loop) and what it appends (hidden + residual, or
  hidden alone);
* the setter: the interface's `set_aux_hidden_state_layers` (stores the ids sorted, once) or the
  class's own (DeepSeek stores them as given) - run on a shell of the decoder;
* the default ids: vLLM's `get_eagle3_default_aux_hidden_state_layers`, run on a shell with N layers;
* the Transformers backend's own setter (an output recorder on HF layer id-1) is named as such.

`tabulate()` writes that for every architecture as data (tpprobe/engines/vllm/rules_table.py, by
`python -m tpprobe.engines.vllm.rules --write`); tpprobe.engines.vllm.layer_ids replays it without vLLM.
tests/engines/vllm/test_vllm_layers.py (vLLM tier) regenerates it from the installed vLLM and asserts it equals the
shipped file, and that the replay equals the captures vLLM's own `_maybe_add_hidden_state` makes.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
from types import SimpleNamespace
from typing import Optional

TABLE_MODULE = "tpprobe/engines/vllm/rules_table.py"
MODELS = "vllm.model_executor.models"


def _src(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _where(fn) -> str:
    try:
        f = inspect.getsourcefile(fn) or ""
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return "?"
    i = f.rfind("/vllm/")
    return f"{f[i + 1:] if i >= 0 else os.path.basename(f)}:{line}"


def holder_class(cls: type) -> Optional[type]:
    """The decoder class `cls.__init__` assigns to self.model (through the MRO), resolved in its module."""
    for k in cls.__mro__:
        m = re.search(r"self\.model\s*=\s*((?:self\.)?[A-Za-z_]\w*)\(", _src(vars(k).get("__init__")))
        if not m:
            continue
        name = m.group(1)
        if name.startswith("self."):
            v = getattr(cls, name[5:], None)
            if isinstance(v, type):                      # self.model_cls(...): a class attribute
                return v
            ret = re.search(r"return\s+([A-Za-z_]\w*)\(", _src(v))   # self._init_model(...): what it returns
            if not ret:
                return None
            name, k = ret.group(1), next(c for c in cls.__mro__ if name[5:] in vars(c))
        h = vars(importlib.import_module(k.__module__)).get(name) or getattr(cls, name, None)
        return h if isinstance(h, type) else None
    return None


def _capturing_forward(holder: type):
    for k in holder.__mro__:
        f = vars(k).get("forward")
        if f is not None and ("_maybe_add_hidden_state" in _src(f) or "aux_hidden_state_layers" in _src(f)):
            return f
    return None


def read_forward(src: str) -> tuple[list[str], str]:
    """(offers, value) of a decoder forward's capture, from its source."""
    s = re.sub(r"\s+", " ", src)
    aux = r"self\.aux_hidden_state_layers"
    add = r"_maybe_add_hidden_state\( ?"
    offers = []
    if re.search(add + r"(\[\]|\w+), ?(0|self\.start_layer) ?,", s) or re.search(r"self\.start_layer in " + aux, s):
        offers.append("start")
    if re.search(add + r"\w+, ?\w+ ?\+ ?1 ?,", s) or re.search(r"\b\w+ ?\+ ?1 in " + aux, s):
        offers.append("after_layer")
    if re.search(r"if (?!self\.)(\w+) in " + aux, s):
        offers.append("before_layer")
    if re.search(r"self\.end_layer in " + aux, s) or re.search(add + r"\w+, ?self\.end_layer ?,", s):
        offers.append("end")
    if "_maybe_add_hidden_state(" in s:
        calls = re.findall(add + r"[^()]*?,[^()]*?,[^()]*?, ?(\w+) ?\)", s)
        value = "h (no residual)" if calls and all(c == "None" for c in calls) else "h+r"
    elif re.search(r"aux_hidden_states?\.append\( ?hidden_states ?\+ ?residual ?\)", s) or \
            re.search(r"aux_hidden_state ?= ?hidden_states ?\+ ?residual", s):
        value = "h+r"
    else:
        value = "h"
    return offers, value


class _Shell(SimpleNamespace):
    pass


def _default(cls: type, N: int):
    fn = getattr(cls, "get_eagle3_default_aux_hidden_state_layers")
    inner = _Shell(layers=[None] * N)
    me = _Shell(model=inner, text_config=SimpleNamespace(num_hidden_layers=N),
                config=SimpleNamespace(num_hidden_layers=N))
    try:
        return list(fn(me))
    except Exception as e:  # noqa: BLE001 - a default that needs more than a shell: said, not guessed
        return f"{type(e).__name__}: {e}"


def _setter_sorts(cls: type, holder: type) -> tuple[bool, str]:
    """Run vLLM's own setter on a shell of the decoder: does it store the ids sorted and once?"""
    import torch

    fn = getattr(cls, "set_aux_hidden_state_layers")
    h = holder.__new__(holder)
    if isinstance(h, torch.nn.Module):
        torch.nn.Module.__init__(h)
    me = _Shell(model=h)
    fn(me, (5, 2, 5))
    got = tuple(getattr(h, "aux_hidden_state_layers", ()))
    own = next((k for k in cls.__mro__ if "set_aux_hidden_state_layers" in vars(k)), cls)
    who = f"{own.__name__}.set_aux_hidden_state_layers ({_where(fn)})"
    if got == (2, 5):
        return True, f"{who} stores the ids sorted, once"
    return False, f"{who} stores the ids as given"


def derive(cls: type) -> dict:
    """The table entry for one vLLM model class (see the module docstring)."""
    setter = getattr(cls, "set_aux_hidden_state_layers")
    d = _default(cls, 8)
    default = "2,N//2,N-3" if all(_default(cls, n) == [2, n // 2, n - 3] for n in (5, 8, 61)) else str(d)
    base = {"cls": cls.__name__, "module": cls.__module__.rsplit(".", 1)[-1], "default": default}
    if "_layer_names[layer - 1]" in re.sub(r"\s+", " ", _src(setter)):
        return {**base, "kind": "hf-recorder", "setter_at": _where(setter), "setter_sorts": False}
    holder = holder_class(cls)
    fwd = _capturing_forward(holder) if holder is not None else None
    if fwd is None:
        return {**base, "kind": "unread", "why": "no decoder forward with an aux capture found"}
    offers, value = read_forward(_src(fwd))
    sorts, setter_text = _setter_sorts(cls, holder)
    return {**base, "kind": "loop", "holder": fwd.__qualname__.split(".")[0], "capture_at": _where(fwd),
            "offers": offers, "value": value, "setter": setter_text, "setter_sorts": sorts}


def architectures() -> tuple[list[tuple[str, type]], dict[str, str]]:
    """([(architecture name, class)] with EAGLE-3 capture, {architecture: why its file was not read})."""
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm.model_executor.models import registry

    out, skipped = [], {}
    for arch, (mod, name) in sorted(registry._VLLM_MODELS.items()):
        try:
            m = importlib.import_module(f"{MODELS}.{mod}")
            cls = getattr(m, name)
        except Exception as e:  # noqa: BLE001 - a model file that cannot import here (no torchvision)
            skipped[arch] = f"{mod}.py does not import here: {type(e).__name__}: {str(e)[:60]}"
            continue
        if getattr(cls, "supports_eagle3", False) and hasattr(cls, "set_aux_hidden_state_layers"):
            out.append((arch, cls))
    return out, skipped


def tabulate() -> dict:
    from tpprobe.engines.vllm import installed_version

    archs, skipped = architectures()
    classes, aliases = {}, {}
    for arch, cls in archs:
        e = derive(cls)
        if e["kind"] == "unread":
            skipped[arch] = e["why"]
            continue
        classes[arch] = e
        m, cur = e["module"], aliases.get(e["module"])   # a model file names its own class: its name, shortest

        def rank(a: str) -> tuple:
            return a != classes[a]["cls"], m.replace("_", "") not in a.lower(), len(a), a
        if cur is None or rank(arch) < rank(cur):
            aliases[m] = arch
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M
    except Exception:  # noqa: BLE001
        M = {}
    for mt, c in sorted(M.items()):
        c = c if isinstance(c, str) else c[0]
        if c in classes and mt not in aliases:
            aliases[mt] = c
    return {"VLLM_VERSION": installed_version(), "CLASSES": classes, "ALIASES": dict(sorted(aliases.items())),
            "NOT_READ": dict(sorted(skipped.items()))}


def render_table(tab: dict) -> str:
    import pprint

    head = (f'"""vLLM {tab["VLLM_VERSION"]}\'s EAGLE-3 capture rules, one entry per architecture: GENERATED by\n'
            f'`python -m tpprobe.engines.vllm.rules --write` from that vLLM\'s own code '
            f'(tpprobe.engines.vllm.rules.tabulate);\n'
            f'tests/engines/vllm/test_vllm_layers.py regenerates it from the installed vLLM and asserts it '
            f'equals this file.\n'
            f'Read by `tpprobe layers --engine vllm` without importing vLLM."""\n')
    body = "".join(f"{k} = {pprint.pformat(tab[k], width=110, sort_dicts=False)}\n\n"
                   for k in ("VLLM_VERSION", "CLASSES", "ALIASES", "NOT_READ"))
    return head + "\n" + body.rstrip() + "\n"


if __name__ == "__main__":   # python -m tpprobe.engines.vllm.rules --write: regenerate the table
    import sys

    text = render_table(tabulate())
    if "--write" in sys.argv:
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
        with open(os.path.join(root, TABLE_MODULE), "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
