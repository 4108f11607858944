"""One rank's record: the tensors it writes and the metadata that becomes rank-NNN.json.

The one builder for `tpprobe probe` and the SGLang plugin, so both write the same schema
(`tpprobe.capture/1`; formats/capture_dir.py reads it back). The record is checked (`check_meta`) before
it is returned: a malformed record fails where it is made, not when a report reads it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..fingerprint.reference import resolved
from .params import replicated_param_hashes
from .points import AUX_PACKED, INPUT_IDS, allreduce_in, allreduce_out


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def aux_meta(packed: Optional[torch.Tensor]) -> dict:
    if packed is None:
        return {}
    return {"shape": list(packed.shape), "dtype": dtype_name(packed.dtype),
            "contiguous": packed.is_contiguous(), "stride": list(packed.stride())}


def point_meta(name: str, t: Optional[torch.Tensor], fp=None) -> dict:
    """One capture point: its shape and dtype (the whole tensor's: a kept tensor may be a sample of
    its rows), and whether the tensor was kept (else only a fingerprint)."""
    if fp is not None:
        return {"name": name, "shape": list(fp.shape), "dtype": fp.dtype, "kept": t is not None}
    if t is not None:
        return {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "kept": True}
    return {"name": name, "shape": list(fp.shape), "dtype": fp.dtype, "kept": False}


def rank_record(tap, *, rank: int, world: int, input_ids: torch.Tensor, model: torch.nn.Module,
                packed: Optional[torch.Tensor] = None, status: str = "ok", error: Optional[str] = None,
                timings: Optional[dict] = None, device=None, extra: Optional[dict] = None,
                params: Optional[dict] = None) -> tuple[dict, dict]:
    """(tensors, meta) of one forward under `tap`: the kept capture points, the audited
    collectives' inputs and outputs, the tokens, the packed aux tensor; `extra` adds keys of the
    caller's own (the probe's hidden size, the plugin's step and forward mode); `params`: the
    replicated-parameter hashes when already taken (on a side stream, the model's being blocked)."""
    tensors = {n: t for n, t in tap.captures.items() if isinstance(t, torch.Tensor)}
    for rec in tap.allreduces:
        if rec.inp is not None and rec.out is not None:
            tensors[allreduce_in(rec.seq)], tensors[allreduce_out(rec.seq)] = rec.inp, rec.out
    tensors[INPUT_IDS] = input_ids
    if packed is not None:
        tensors[AUX_PACKED] = packed
    meta = {
        "rank": rank, "world_size": world, "status": status, "error": error,
        "points": [point_meta(n, tensors.get(n), tap.summaries.get(n)) for n in dict.fromkeys(tap.order)
                   if n in tensors or n in tap.summaries],
        "allreduces": [r.meta() for r in tap.allreduces], "unreduced_rows": tap.unreduced_rows(),
        "embed_module": tap.embed_name, "layers_hooked": len(tap.layer_indices), "coverage": tap.coverage(),
        "aux": aux_meta(packed), "params": replicated_param_hashes(model) if params is None else params,
        "timings": dict(timings or {}), "device": str(device if device is not None else input_ids.device),
        **(extra or {}),
    }
    check_meta(meta)
    return tensors, meta


def check_meta(meta) -> None:
    """The shape of a rank's metadata the checks rely on (ValueError says what is off)."""
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    pts = meta.get("points", [])
    if not isinstance(pts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("name"), str)
            and isinstance(p.get("shape", []), list) and all(isinstance(d, int) for d in p.get("shape", []))
            and isinstance(p.get("dtype", ""), str) for p in pts):
        raise ValueError("'points' must be a list of {name, shape, dtype}")
    ars = meta.get("allreduces", [])
    if not isinstance(ars, list) or not all(
            isinstance(a, dict) and isinstance(a.get("where"), str) and isinstance(a.get("shape"), list)
            and all(isinstance(d, int) for d in a["shape"]) and isinstance(a.get("group_size"), int)
            and isinstance(a.get("op"), str) and isinstance(a.get("seq"), int) for a in ars):
        raise ValueError("'allreduces' must be a list of {seq, where, shape, group_size, op}")
    for k in ("status", "error", "embed_module"):
        if not (meta.get(k) is None or isinstance(meta.get(k), str)):
            raise ValueError(f"{k!r} must be a string")
    for k in ("aux", "params", "timings"):
        if not isinstance(meta.get(k, {}), dict):
            raise ValueError(f"{k!r} must be an object")


def resolve_summaries(tap, summarize, device_ok: bool) -> None:
    """The forward's deferred fingerprints, read in one copy (resolved on the side stream already,
    or dropped, when the device stayed blocked)."""
    if summarize is None:
        return
    summarize.resolve() if device_ok else summarize.drop()
    tap.summaries = {n: resolved(v) for n, v in tap.summaries.items() if resolved(v) is not None}
    for rec in tap.allreduces:
        rec.inp_summary, rec.out_summary = resolved(rec.inp_summary), resolved(rec.out_summary)
