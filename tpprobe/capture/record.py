"""One rank's record: the tensors it writes and the metadata that becomes rank-NNN.json.

`rank_record` is the one builder, for `tpprobe probe`, both engine plugins (tpprobe/engines/step.py)
and the GPU graph proof (builtin/graph.py), so all of them write the same schema (`tpprobe.capture/1`;
formats/capture_dir.py reads it back). It returns a frozen `RankRecord`, complete when made: every
point's and collective's fingerprint, which candidate each aux slot equals (capture/slots.py) and the
fingerprint path's notes are inputs of the one call, never keys added to its JSON afterwards.
`to_json()` is checked (`check_meta`): a malformed record fails where it is made, not when a report
reads it. (formats.capture_dir.LoadedRank is a rank read back: its number, that JSON and its tensors.)
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from ..fingerprint.reference import PROBE_K, PROBE_SEED, TORCH_PATH, fingerprint, host_combine_notes, resolved
from .params import replicated_param_hashes
from .points import AUX_PACKED, INPUT_IDS, allreduce_in, allreduce_out
from .slots import tap_slot_match


class Sketch(NamedTuple):
    """The signs every rank fingerprints with (the same on every rank of a run)."""
    seed: int
    k: int


PROBE_SKETCH = Sketch(PROBE_SEED, PROBE_K)   # `tpprobe probe --exchange fingerprint` and the plugins


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


@dataclass(frozen=True)
class RankRecord:
    """One rank's forward, as it is written: `tensors` (rank-NNN.safetensors) and the fields of
    rank-NNN.json (`to_json`). Made by `rank_record` only; nothing is added to it afterwards."""
    rank: int
    world_size: int
    status: str
    error: Optional[str]
    points: list                    # point_meta per capture point, in the order the forward ran them
    collectives: list               # the audit's records (JSON "allreduces"), with in_fp / out_fp when fingerprinted
    unreduced_rows: list
    embed_module: Optional[str]
    layers_hooked: int
    coverage: Optional[dict]        # what was hooked and audited (None: not said, the JSON has no key)
    aux: dict                       # the whole packed aux tensor's layout (aux_meta), {} without one
    params: dict                    # replicated-parameter hashes
    timings: dict
    device: str
    extra: dict                     # the caller's own facts (the plugins' step, forward mode, parallel ranks)
    hidden: Optional[int]
    fingerprints: Optional[dict] = None     # point name -> fingerprint JSON (--exchange fingerprint, plugins)
    notes: dict = field(default_factory=dict)   # why the fingerprint kernels were not used as planned
    slot_match: Optional[list] = None       # per aux slot, the candidate it equals (matched on the rank)
    slot_fps: Optional[dict] = None         # slot index -> fingerprint JSON of each slot that equals none
    kept_bytes: Optional[int] = None        # the plugins: bytes of tensors kept under the budget
    tensors: dict = field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> dict:
        """rank-NNN.json's object (a fresh copy; checked with check_meta)."""
        meta = {
            "rank": self.rank, "world_size": self.world_size, "status": self.status, "error": self.error,
            "points": self.points, "allreduces": self.collectives, "unreduced_rows": self.unreduced_rows,
            "embed_module": self.embed_module, "layers_hooked": self.layers_hooked,
            **({} if self.coverage is None else {"coverage": self.coverage}),
            "aux": self.aux, "params": self.params, "timings": self.timings, "device": self.device,
            **self.extra, "hidden": self.hidden,
        }
        if self.fingerprints is not None:
            meta["fingerprints"] = self.fingerprints
        meta.update(self.notes)
        if self.slot_match is not None:
            meta["slot_match"] = self.slot_match
        if self.slot_fps:
            meta["slot_fps"] = self.slot_fps
        if self.kept_bytes is not None:
            meta["kept_bytes"] = self.kept_bytes
        meta = copy.deepcopy(meta)
        check_meta(meta)
        return meta


def _fp_json(fp):
    """A fingerprint, or a list of them (a reduce-scatter's input / all-gather's output, per chunk)."""
    return [f.to_json() for f in fp] if isinstance(fp, list) else fp.to_json()


def collective_meta(rec, fingerprinted: bool) -> dict:
    """One audited collective's JSON, with its input's and output's fingerprints when both were taken."""
    m = rec.meta()
    if fingerprinted and rec.inp_summary is not None and rec.out_summary is not None:
        m["in_fp"], m["out_fp"] = _fp_json(rec.inp_summary), _fp_json(rec.out_summary)
    return m


def fingerprint_notes(device: str) -> dict:
    """On a GPU: why the fused fingerprint kernel was not used (the torch path's reasons) and why its
    partials were combined on the host instead of the device, when either happened."""
    notes: dict = {}
    if str(device).startswith("cuda"):
        if TORCH_PATH:
            notes["fingerprint_torch_path"] = dict(TORCH_PATH)
        combine = host_combine_notes()
        if combine:
            notes["fingerprint_host_combine"] = combine
    return notes


def rank_record(tap, *, rank: int, world: int, input_ids: Optional[torch.Tensor], model: torch.nn.Module,
                hidden: Optional[int], packed: Optional[torch.Tensor] = None, aux: Optional[torch.Tensor] = None,
                status: str = "ok", error: Optional[str] = None, timings: Optional[dict] = None, device=None,
                extra: Optional[dict] = None, params: Optional[dict] = None, fingerprints: Optional[Sketch] = None,
                slot_dtype: Optional[torch.dtype] = None, count_kept: bool = False,
                record_started: Optional[float] = None, with_coverage: bool = True) -> RankRecord:
    """The record of one forward under `tap` (its summaries resolved to Fingerprints).

    Tensors: the kept capture points, the audited collectives' inputs and outputs, `input_ids` (None:
    not kept), `packed` (the packed aux tensor as kept: whole, a sample of its rows, or None). `aux`:
    the whole packed aux tensor (default `packed`) its layout, fingerprint and slot match describe.
    `fingerprints` (a Sketch): every point's and collective's fingerprint, the aux's, and the slot match
    (judged in `slot_dtype`). `extra`: keys of the caller's own; `params`: the replicated-parameter
    hashes when already taken (on a side stream, the model's being blocked); `count_kept`: say the kept
    bytes; `record_started`: timings gets record_s, the seconds from then until this record is made;
    `with_coverage`: False for a forward the tap's hooks did not watch (a CUDA graph's replay)."""
    aux = packed if aux is None else aux
    tensors = {n: t for n, t in tap.captures.items() if isinstance(t, torch.Tensor)}
    for rec in tap.allreduces:
        if rec.inp is not None and rec.out is not None:
            tensors[allreduce_in(rec.seq)], tensors[allreduce_out(rec.seq)] = rec.inp, rec.out
    if input_ids is not None:
        tensors[INPUT_IDS] = input_ids
    if packed is not None:
        tensors[AUX_PACKED] = packed
    device = str(device if device is not None else input_ids.device)
    fps, notes, slot_match, slot_fps = None, {}, None, None
    if fingerprints is not None:
        fps = {n: f.to_json() for n, f in tap.summaries.items()}
        if aux is not None:
            fps[AUX_PACKED] = fingerprint(aux, seed=fingerprints.seed, k=fingerprints.k).to_json()
            slot_match = tap_slot_match(tap, aux, hidden, slot_dtype or aux.dtype)
            slot_fps = unmatched_slot_fps(aux, hidden, slot_match, fingerprints)
        notes = fingerprint_notes(device)
    timings = dict(timings or {})
    if record_started is not None:
        timings["record_s"] = time.time() - record_started
    return RankRecord(
        rank=rank, world_size=world, status=status, error=error,
        points=[point_meta(n, tensors.get(n), tap.summaries.get(n)) for n in dict.fromkeys(tap.order)
                if n in tensors or n in tap.summaries],
        collectives=[collective_meta(r, fingerprints is not None) for r in tap.allreduces],
        unreduced_rows=tap.unreduced_rows(), embed_module=tap.embed_name, layers_hooked=len(tap.layer_indices),
        coverage=tap.coverage() if with_coverage else None, aux=aux_meta(aux),
        params=replicated_param_hashes(model) if params is None else params, timings=timings, device=device,
        extra=dict(extra or {}), hidden=hidden, fingerprints=fps, notes=notes, slot_match=slot_match,
        slot_fps=slot_fps,
        kept_bytes=sum(t.numel() * t.element_size() for t in tensors.values()) if count_kept else None,
        tensors=tensors)


def unmatched_slot_fps(aux: torch.Tensor, hidden: int, slot_match, sketch) -> Optional[dict]:
    """The fingerprint of each aux slot that equals no candidate (its index as a string -> JSON): the sketches
    are linear, so the checks can still ask what the slot is made of (checks/causes.py: a partial sum, a
    reduce's output without the residual) with no tensor moved. None when every slot matched."""
    if not slot_match or None not in slot_match:
        return None
    slots = aux.split(hidden, dim=-1)
    return {str(i): fingerprint(slots[i], seed=sketch.seed, k=sketch.k).to_json()
            for i, m in enumerate(slot_match) if m is None and i < len(slots)}


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
    for k in ("aux", "params", "timings", "coverage"):
        if not isinstance(meta.get(k, {}), dict):
            raise ValueError(f"{k!r} must be an object")
    if not all(isinstance(e, dict) for e in (meta.get("params") or {}).values()):
        raise ValueError("'params' must map each parameter's name to an object")
    if not isinstance((meta.get("coverage") or {}).get("unreadable_points") or {}, dict):
        raise ValueError("'coverage.unreadable_points' must be an object")


def resolve_summaries(tap, summarize, device_ok: bool) -> None:
    """The forward's deferred fingerprints, read in one copy (resolved on the side stream already,
    or dropped, when the device stayed blocked)."""
    if summarize is None:
        return
    summarize.resolve() if device_ok else summarize.drop()
    tap.summaries = {n: resolved(v) for n, v in tap.summaries.items() if resolved(v) is not None}
    for rec in tap.allreduces:
        rec.inp_summary, rec.out_summary = resolved(rec.inp_summary), resolved(rec.out_summary)
