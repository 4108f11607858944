"""Hashes of the parameters every rank must hold alike (the checks compare them across ranks).

Used by the probe and by the SGLang plugin alike."""
from __future__ import annotations

import fnmatch
import hashlib

import torch

SHARDED_MODULES = ("*ParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "*MoE*", "*Experts*")
# replicated parameters that live inside parallel layers: a row-parallel layer's bias (added after the
# reduce, so every rank holds all of it), an MoE router / gate (every rank must pick the same experts),
# norms, anything marked `tp_replicated = True`
ROW_PARALLEL = ("*RowParallel*",)
REPLICATED_MODULES = ("*Norm*", "Replicated*", "*Router*", "*TopK*Gate*", "MoEGate")
REPLICATED_NAMES = ("router", "gate")        # a module attribute named exactly so (not gate_proj)


def _replicated(mname: str, m: torch.nn.Module, pname: str) -> bool:
    cls = type(m).__name__
    if pname == "bias" and any(fnmatch.fnmatchcase(cls, p) for p in ROW_PARALLEL):
        return True
    if any(fnmatch.fnmatchcase(cls, p) for p in REPLICATED_MODULES):
        return True
    return mname.rsplit(".", 1)[-1] in REPLICATED_NAMES


def replicated_param_hashes(model: torch.nn.Module) -> dict:
    """Hashes of parameters that are not known to be TP-sharded. `replicated` is True where the
    model's structure says so (see _replicated: row-parallel biases, routers, norms) or a parameter
    is marked `tp_replicated = True`, None where unknown (a plain parameter of a user's module may
    be a shard: the checks then need a majority)."""
    out = {}
    for mname, m in model.named_modules():
        sharded = any(fnmatch.fnmatchcase(type(m).__name__, p) for p in SHARDED_MODULES)
        for pname, p in m.named_parameters(recurse=False):
            rep = _replicated(mname, m, pname) or getattr(p, "tp_replicated", False)
            if sharded and not rep:
                continue
            if not rep and (getattr(p, "input_dim", None) is not None or getattr(p, "output_dim", None) is not None
                            or getattr(p, "tp_sharded", False)):
                continue
            known = True if rep else None
            data = p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            layer = next((int(x) for x in mname.split(".") if x.isdigit()), None)
            out[f"{mname}.{pname}" if mname else pname] = {
                "hash": hashlib.sha1(data).hexdigest(), "layer": layer,
                "replicated": known}
    return out
