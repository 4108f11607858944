"""Finding a model's embedding and decoder layers from its structure, not from class names.

Decoder layers: by default the longest layer container of the model that is not nested inside an
element of another one (so an MoE's `experts` list never wins over the layer list that holds it).
A layer container is an `nn.ModuleList`, or an `nn.ModuleDict` / `nn.Sequential` whose elements are
all of one class (torchtitan keeps its blocks in `ModuleDict({"0": block, ...})`; a Sequential of
Linear, ReLU, Linear is not a layer list). Its elements are the layers, indexed by position (a
ModuleDict's integer keys when every key is one). Override with a module path
(`model.encoder.layers`: any of the three containers) or a class-name glob (`*DecoderLayer`).

Embedding: by default the module that consumes the input ids and emits one hidden row per token —
found during the forward (`EmbeddingProbe`): the outermost module outside the layer list (never
the model itself, never an ancestor of the layers) whose arguments include an integer tensor
holding the probe's input ids (in any shape: `[tokens]`, `[1, tokens]`, `[batch, seq]`; any
integer tensor when the ids are not known, e.g. in the SGLang plugin) and whose first output is a
floating tensor of rows in one of the token layouts: `ids.shape + [hidden]` (`[b, s, h]`), the
two leading dims swapped (`[s, b, h]`, Megatron), or `[tokens, hidden]`. When the outermost
module that consumed the ids does not emit such rows, the innermost match inside it is taken
(Megatron's `LanguageModelEmbedding` around its `VocabParallelEmbedding`). `rows(t, layout)` turns
a tensor in that layout into `[tokens, hidden]` in the ids' order. Override with a module path or
a class-name glob.

`resolve(model, spec)` turns an override into modules, or raises UsageError saying what exists.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Optional

import torch
from torch import nn

from ..core.errors import UsageError
from .rowparallel import is_row_parallel as row_parallel_rule

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


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _children(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(m._modules.items()) if isinstance(m, CONTAINERS) else []


def is_layer_container(m: nn.Module) -> bool:
    """A ModuleList (as before: any elements), or a ModuleDict / Sequential of one class of block."""
    if isinstance(m, nn.ModuleList):
        return len(m) > 0
    if isinstance(m, (nn.ModuleDict, nn.Sequential)):
        kids = [c for _, c in _children(m)]
        return bool(kids) and all(c is not None and type(c) is type(kids[0]) for c in kids) \
            and any(True for _ in kids[0].parameters())
    return False


def _elements(name: str, m: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """[(index, qualified name, layer)]: positions; a ModuleDict's keys when all are integers."""
    kids = [(k, c) for k, c in _children(m) if c is not None]
    by_key = isinstance(m, nn.ModuleDict) and all(k.isdigit() for k, _ in kids)
    out = [(int(k) if by_key else i, f"{name}.{k}" if name else k, c) for i, (k, c) in enumerate(kids)]
    return sorted(out, key=lambda x: x[0]) if by_key else out


def is_row_parallel(m: nn.Module) -> bool:
    """A module whose output is a partial sum until a reduce, recognised from what it declares
    (a DTensor weight sharded on its input dim, `input_is_parallel`, a reduce flag) before its class
    name: one rule, `rowparallel.is_row_parallel`."""
    return row_parallel_rule(m)


def _suggest(model: nn.Module) -> str:
    lists = [f"{n} ({len(m)} × {type(_children(m)[0][1]).__name__}, {type(m).__name__})"
             for n, m in model.named_modules() if is_layer_container(m)]
    return "layer containers in this model: " + (", ".join(lists[:6]) if lists else "none")


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
        if not isinstance(m, CONTAINERS):
            raise UsageError(f"--layer-list {spec!r} is a {type(m).__name__}, not a list of layers "
                             f"(nn.ModuleList, nn.ModuleDict or nn.Sequential); " + _suggest(model))
        return "path", spec, _elements(spec, m)
    lists = [(n, m) for n, m in model.named_modules() if is_layer_container(m)]
    outer = [(n, m) for n, m in lists
             if not any(n.startswith(f"{o}.") and n != o for o, _ in lists)]
    if not outer:
        return "structure", "", []
    name, best = max(outer, key=lambda x: len(x[1]))        # first of the longest, in module order
    return "structure", name, _elements(name, best)


def embedding(model: nn.Module, spec: str) -> tuple[str, nn.Module]:
    """The embedding an override names (module path, or the first module of a class glob)."""
    if _is_glob_or_class(model, spec):
        hits = _classes(model, spec)
        if not hits:
            raise UsageError(f"--embed {spec!r}: no module of that class (and no module at that path); "
                             f"give the embedding's module path, e.g. model.embed_tokens")
        return hits[0]
    return spec, model.get_submodule(spec)


def candidates(model: nn.Module, layers: list[tuple[int, str, nn.Module]],
               list_name: str) -> list[tuple[str, nn.Module]]:
    """Modules that may be the embedding: outside every layer, and not an ancestor of the layers."""
    layer_names = [n for _, n, _ in layers]
    out = []
    for n, m in model.named_modules():
        if n == "":
            continue                          # the model itself is never its own embedding
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


def _same_ids(a: torch.Tensor, ids: torch.Tensor) -> bool:
    if a is ids:
        return True
    if a.numel() != ids.numel() or a.device != ids.device:
        return False
    if a.shape == ids.shape or a.dim() == 1 or ids.dim() == 1:
        return bool(torch.equal(a.reshape(-1), ids.reshape(-1)))
    return False


def consumes_ids(args, kwargs, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The argument that holds the input ids (the same values as `ids`, in its shape or flattened,
    when known), or None."""
    for a in _int_tensors(args, kwargs):
        if ids is None or _same_ids(a, ids):
            return a
    return None


BSH, SBH, TH = "bsh", "sbh", "th"          # token layouts of an embedding's rows (see rows())
SBH_SP = "sbh/sp"     # [s / world, b, h]: this rank's chunk of the sequence (Megatron's sequence parallelism)
BSH_SP = "bsh/sp"     # [b, s / world, h]: the same chunk in [b, s, h] (torch's SequenceParallel, Shard(1))


def hidden_layout(output, ids: torch.Tensor, world: int = 1) -> Optional[str]:
    """The token layout of a module's first output for these ids (BSH: ids.shape + [h]; SBH: the two
    leading dims swapped; TH: [tokens, h]; SBH_SP: SBH's sequence split in `world` chunks, one per
    rank), or None when it is not one hidden row per token."""
    t = output if isinstance(output, torch.Tensor) else next(
        (o for o in output if isinstance(o, torch.Tensor)), None) if isinstance(output, (tuple, list)) else None
    if t is None or not t.dtype.is_floating_point or t.dim() < 2:
        return None
    lead = tuple(t.shape[:-1])
    if lead == tuple(ids.shape):
        return BSH
    if ids.dim() == 2 and lead == (ids.shape[1], ids.shape[0]):
        return SBH
    if lead == (ids.numel(),):
        return TH
    if world > 1 and ids.dim() == 2 and ids.shape[1] % world == 0 and lead == (ids.shape[1] // world, ids.shape[0]):
        return SBH_SP
    if world > 1 and ids.dim() == 2 and ids.shape[1] % world == 0 and lead == (ids.shape[0], ids.shape[1] // world):
        return BSH_SP
    return None


def is_sequence_shard(t: torch.Tensor, layout: Optional[str], ids_shape: Optional[tuple], world: int) -> bool:
    """A stream tensor that holds this rank's chunk of the sequence (SBH_SP, BSH_SP), to be gathered."""
    if ids_shape is None or t.dim() != 3 or len(ids_shape) != 2:
        return False
    if layout == SBH_SP:
        return tuple(t.shape[:2]) == (ids_shape[1] // world, ids_shape[0])
    return layout == BSH_SP and tuple(t.shape[:2]) == (ids_shape[0], ids_shape[1] // world)


def rows(t: torch.Tensor, layout: Optional[str], ids_shape: Optional[tuple]) -> torch.Tensor:
    """A stream tensor in the embedding's layout as [tokens, hidden], tokens in the ids' order (a
    view where it can be); a tensor of another shape (a sequence-parallel shard) as it is."""
    if layout is None or ids_shape is None or t.dim() < 2:
        return t
    n = 1
    for d in ids_shape:
        n *= d
    if layout in (SBH, SBH_SP) and t.dim() == 3 and tuple(t.shape[:2]) == (ids_shape[1], ids_shape[0]):
        t = t.transpose(0, 1)
    elif tuple(t.shape[:-1]) not in (tuple(ids_shape), (n,)):
        return t
    return t.reshape(n, t.shape[-1]) if t.dim() != 2 else t
