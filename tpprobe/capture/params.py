"""Hashes of the parameters every rank must hold alike (the checks compare them across ranks).

Used by the probe and by the SGLang plugin alike."""
from __future__ import annotations

import fnmatch
import hashlib

import torch

SHARDED_MODULES = ("*ParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "*MoE*", "*Experts*")


def replicated_param_hashes(model: torch.nn.Module) -> dict:
    """Hashes of parameters that are not known to be TP-sharded. `replicated` is True where the
    model says so (norm layers, or a parameter marked `tp_replicated = True`), None where unknown
    (a plain parameter of a user's module may be a shard: the checks then need a majority)."""
    out = {}
    for mname, m in model.named_modules():
        if any(fnmatch.fnmatchcase(type(m).__name__, p) for p in SHARDED_MODULES):
            continue
        known = True if fnmatch.fnmatchcase(type(m).__name__, "*Norm*") else None
        for pname, p in m.named_parameters(recurse=False):
            if getattr(p, "input_dim", None) is not None or getattr(p, "output_dim", None) is not None \
                    or getattr(p, "tp_sharded", False):
                continue
            data = p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            layer = next((int(x) for x in mname.split(".") if x.isdigit()), None)
            out[f"{mname}.{pname}" if mname else pname] = {
                "hash": hashlib.sha1(data).hexdigest(), "layer": layer,
                "replicated": True if getattr(p, "tp_replicated", False) else known}
    return out
