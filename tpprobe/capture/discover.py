"""Finding a model's embedding and decoder layers from its structure, not from class names.

Decoder layers: by default the longest `nn.ModuleList` of the model that is not nested inside an
element of another ModuleList (so an MoE's `experts` list never wins over the layer list that
holds it); its elements are the layers, indexed by position. Override with a module path
(`model.encoder.layers`) or a class-name glob (`*DecoderLayer`, `ParallelTransformerLayer`).

Embedding: by default the module that consumes the input ids and emits [tokens, hidden] — found
during the forward (`EmbeddingProbe`): the outermost module outside the layer list (and not
holding it) whose arguments include an integer tensor equal to the probe's input ids (any integer
tensor when the ids are not known, e.g. in the SGLang plugin) and whose first output is a floating
tensor shaped ids.shape + [hidden]. Override with a module path or a class-name glob.

`resolve(model, spec)` turns an override into modules, or raises UsageError saying what exists.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Optional

import torch
from torch import nn

from ..errors import UsageError

_IDX = re.compile(r"(\d+)$")


def _is_glob_or_class(model: nn.Module, spec: str) -> bool:
    if any(c in spec for c in "*?["):
        return True
    try:
        model.get_submodule(spec)
        return False
    except AttributeError:
        return True


def _classes(model: nn.Module, spec: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if fnmatch.fnmatchcase(type(m).__name__, spec)]


def _suggest(model: nn.Module) -> str:
    lists = [f"{n} ({len(m)} × {type(m[0]).__name__})" for n, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m)]
    return "ModuleLists in this model: " + (", ".join(lists[:6]) if lists else "none")


def layer_list(model: nn.Module, spec: Optional[str] = None) -> tuple[str, str, list[tuple[int, str, nn.Module]]]:
    """(how it was found, what, [(index, name, module)]) of the decoder layers."""
    if spec:
        if _is_glob_or_class(model, spec):
            hits = _classes(model, spec)
            if not hits:
                raise UsageError(f"--layer-list {spec!r}: no module of that class (and no module at that path); "
                                 + _suggest(model))
            out = []
            for i, (n, m) in enumerate(hits):
                g = _IDX.search(n)
                out.append((int(g.group(1)) if g else i, n, m))
            out.sort(key=lambda x: x[0])
            return "class", spec, out
        m = model.get_submodule(spec)
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            raise UsageError(f"--layer-list {spec!r} is a {type(m).__name__}, not a list of layers "
                             f"(nn.ModuleList); " + _suggest(model))
        return "path", spec, [(i, f"{spec}.{i}", c) for i, c in enumerate(m)]
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    outer = [(n, m) for n, m in lists
             if not any(n.startswith(f"{o}.") and n != o for o, _ in lists)]
    if not outer:
        return "structure", "", []
    name, best = max(outer, key=lambda x: len(x[1]))        # first of the longest, in module order
    return "structure", name, [(i, f"{name}.{i}" if name else str(i), c) for i, c in enumerate(best)]


def embedding(model: nn.Module, spec: str) -> tuple[str, nn.Module]:
    """The embedding an override names (module path, or the first module of a class glob)."""
    if _is_glob_or_class(model, spec):
        hits = _classes(model, spec)
        if not hits:
            raise UsageError(f"--embed {spec!r}: no module of that class (and no module at that path); "
                             f"give the embedding's module path, e.g. model.embed_tokens")
        return hits[0]
    return spec, model.get_submodule(spec)


def candidates(model: nn.Module, layers: list[tuple[int, str, nn.Module]], list_name: str) -> list[tuple[str, nn.Module]]:
    """Modules that may be the embedding: outside every layer, and not an ancestor of the layers."""
    layer_names = [n for _, n, _ in layers]
    out = []
    for n, m in model.named_modules():
        if n == "" and layers:
            continue                          # the whole model holds the layers
        if any(n == ln or n.startswith(ln + ".") for ln in layer_names):
            continue
        if layers and any(ln.startswith(n + ".") for ln in layer_names):
            continue                          # an ancestor of the layer list
        if list_name and (n == list_name):
            continue
        out.append((n, m))
    return out


def _int_tensors(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and not a.dtype.is_floating_point and not a.dtype.is_complex \
                and a.dtype != torch.bool:
            yield a


def consumes_ids(args, kwargs, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The argument that holds the input ids (equal to `ids` when known), or None."""
    for a in _int_tensors(args, kwargs):
        if ids is None:
            return a
        if a is ids or (a.shape == ids.shape and a.device == ids.device and bool(torch.equal(a, ids))):
            return a
    return None


def emits_hidden(output, ids: torch.Tensor) -> bool:
    t = output if isinstance(output, torch.Tensor) else next(
        (o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None
    return t is not None and t.dtype.is_floating_point and t.dim() == ids.dim() + 1 \
        and tuple(t.shape[:-1]) == tuple(ids.shape)
