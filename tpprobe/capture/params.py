"""Hashes of the parameters every rank must hold alike (the checks compare them across ranks).

Used by the probe and by the SGLang plugin alike. No numpy: a tensor's bytes are read with
`tensor_bytes` (ctypes over the contiguous CPU copy). A DTensor parameter is sharded when any of
its placements is `Shard` (skipped) and replicated when every placement is `Replicate` (its local
tensor is hashed); a parameter tpprobe cannot read is kept with `hash: None` and the reason, and
the coverage check names it: one unreadable parameter never kills a rank's record."""
from __future__ import annotations

import fnmatch
import hashlib

import torch

from ..core.tensors import tensor_bytes

SHARDED_MODULES = ("*ParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "*MoE*", "*Experts*")
# replicated parameters that live inside parallel layers: a row-parallel layer's bias (added after the
# reduce, so every rank holds all of it), an MoE router / gate (every rank must pick the same experts),
# norms, anything marked `tp_replicated = True`
ROW_PARALLEL = ("*RowParallel*",)
REPLICATED_MODULES = ("*Norm*", "Replicated*", "*Router*", "*TopK*Gate*", "MoEGate")
REPLICATED_NAMES = ("router", "gate")        # a module attribute named exactly so (not gate_proj)


def dtensor_placements(t) -> tuple | None:
    """The placements' names of a DTensor (`("Shard(0)",)`, `("Replicate()",)`), None for a plain tensor."""
    placements = getattr(t, "placements", None)
    if placements is None or not hasattr(t, "to_local"):
        return None
    return tuple(repr(p) for p in placements)     # repr: "Shard(0)"; torch 2.13's str() is "S(0)"


def _local(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: a DTensor's local tensor, else the tensor itself."""
    return p.to_local() if dtensor_placements(p) is not None else p


def _replicated(mname: str, m: torch.nn.Module, pname: str) -> bool:
    cls = type(m).__name__
    if pname == "bias" and any(fnmatch.fnmatchcase(cls, p) for p in ROW_PARALLEL):
        return True
    if any(fnmatch.fnmatchcase(cls, p) for p in REPLICATED_MODULES):
        return True
    return mname.rsplit(".", 1)[-1] in REPLICATED_NAMES


def _sharded_attr(p) -> bool:
    return (getattr(p, "input_dim", None) is not None or getattr(p, "output_dim", None) is not None
            or bool(getattr(p, "tp_sharded", False)))


def replicated_param_hashes(model: torch.nn.Module) -> dict:
    """Hashes of parameters that are not known to be TP-sharded. `replicated` is True where the
    model's structure says so (see _replicated: row-parallel biases, routers, norms; a DTensor whose
    placements are all Replicate) or a parameter is marked `tp_replicated = True`, None where
    unknown (a plain parameter of a user's module may be a shard: the checks then need a majority).
    Sharded: a parallel module's weight, `tp_sharded = True`, `input_dim` / `output_dim` (SGLang's
    and vLLM's loaders), a DTensor with a Shard placement."""
    out = {}
    for mname, m in model.named_modules():
        sharded = any(fnmatch.fnmatchcase(type(m).__name__, p) for p in SHARDED_MODULES)
        for pname, p in m.named_parameters(recurse=False):
            placements = dtensor_placements(p)
            if placements is not None and any(x.startswith("Shard") for x in placements):
                continue
            rep = (_replicated(mname, m, pname) or bool(getattr(p, "tp_replicated", False))
                   or (placements is not None and all(x.startswith("Replicate") for x in placements)))
            if not rep and (sharded or _sharded_attr(p)):
                continue
            name = f"{mname}.{pname}" if mname else pname
            entry = {"layer": next((int(x) for x in mname.split(".") if x.isdigit()), None),
                     "replicated": True if rep else None}
            if placements is not None:
                entry["placements"] = list(placements)
            try:
                entry["hash"] = hashlib.sha1(tensor_bytes(_local(p))).hexdigest()
            except Exception as e:   # a tensor subclass with no readable storage: named, never fatal
                entry["hash"] = None
                entry["unreadable"] = f"{type(p).__name__}: {type(e).__name__}: {e}"[:200]
            out[name] = entry
    return out
