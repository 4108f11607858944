"""One rank's record: the tensors it writes and the metadata that becomes rank-NNN.json.

`rank_record` is the one builder, for `tpprobe probe`, both engine plugins (tpprobe/engines/step.py)
and the GPU graph proof (builtin/graph.py), so all of them write the same schema (`tpprobe.capture/1`;
formats/capture_dir.py reads it back). It returns a frozen `RankRecord`, complete when made: every
point's and collective's fingerprint, which candidate each aux slot equals (capture/slots.py) and the
fingerprint path's notes are inputs of the one call, never keys added to its JSON afterwards. Its parts
are typed (capture/schema.py) and checked when made: a malformed record fails where it is made, not when
a report reads it. `RankRecord.from_json` reads rank-NNN.json back as the same type, validated
(formats.capture_dir.LoadedRank is a rank read back: its number, that record and its tensors).
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
from .schema import (REDUCE_KINDS, AuxLayout, Collective, Coverage, ParamHash, Point, UnreducedRow, dict_, dict_of,
                     int_, list_of, optional, str_)
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


NOTE_KEYS = ("fingerprint_torch_path", "fingerprint_host_combine")   # fingerprint_notes' keys


@dataclass(frozen=True)
class RankRecord:
    """One rank's forward, as it is written: `tensors` (rank-NNN.safetensors) and the fields of
    rank-NNN.json (`to_json`), and as it is read back (`from_json`: the same type, its tensors apart).
    Made by `rank_record` only; nothing is added to it afterwards."""
    rank: int
    world_size: int
    status: Optional[str]
    error: Optional[str]
    points: list[Point]             # per capture point, in the order the forward ran them
    collectives: list[Collective]   # the audit's records (JSON "allreduces"), with in_fp / out_fp when fingerprinted
    unreduced_rows: list[UnreducedRow]
    embed_module: Optional[str]
    layers_hooked: int
    coverage: Optional[Coverage]    # what was hooked and audited (None: not said, the JSON has no key)
    aux: Optional[AuxLayout]        # the whole packed aux tensor's layout (None: no aux tensor, JSON {})
    params: dict[str, ParamHash]    # replicated-parameter hashes
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
        """rank-NNN.json's object (a fresh copy)."""
        meta = {
            "rank": self.rank, "world_size": self.world_size, "status": self.status, "error": self.error,
            "points": [p.to_json() for p in self.points], "allreduces": [a.to_json() for a in self.collectives],
            "unreduced_rows": [u.to_json() for u in self.unreduced_rows],
            "embed_module": self.embed_module, "layers_hooked": self.layers_hooked,
            **({} if self.coverage is None else {"coverage": self.coverage.to_json()}),
            "aux": {} if self.aux is None else self.aux.to_json(),
            "params": {n: e.to_json() for n, e in self.params.items()}, "timings": self.timings,
            "device": self.device, **self.extra, "hidden": self.hidden,
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
        return copy.deepcopy(meta)

    @classmethod
    def from_json(cls, meta, tensors: Optional[dict] = None) -> "RankRecord":
        """rank-NNN.json's object read back (a ValueError names the field that is missing or of the wrong
        type: formats/capture_dir.py reports it as the folder's load problem). The fields of the first
        schema are required; those added later (coverage, hidden, fingerprints, the slot match, ...) are
        optional; keys of a writer's own go to `extra`."""
        obj = dict_(meta, "the rank's metadata")
        for k in REQUIRED:
            if k not in obj:
                raise ValueError(f"the rank's metadata has no {k!r}")
        v = {k: parse(obj[k], repr(k)) if k in obj else None for k, parse in FIELDS.items()}
        aux = v["aux"] or {}
        return cls(
            rank=v["rank"], world_size=v["world_size"], status=v["status"], error=v["error"], points=v["points"],
            collectives=v["allreduces"], unreduced_rows=v["unreduced_rows"], embed_module=v["embed_module"],
            layers_hooked=v["layers_hooked"], coverage=v["coverage"],
            aux=AuxLayout.from_json(aux, "'aux'") if aux else None, params=v["params"], timings=v["timings"],
            device=v["device"], extra={k: x for k, x in obj.items() if k not in FIELDS and k not in NOTE_KEYS},
            hidden=v["hidden"], fingerprints=v["fingerprints"], notes={k: obj[k] for k in NOTE_KEYS if k in obj},
            slot_match=v["slot_match"], slot_fps=v["slot_fps"], kept_bytes=v["kept_bytes"], tensors=dict(tensors or {}))

    @property
    def reduces(self) -> list[Collective]:
        """The collectives that sum partial results (all-reduce, reduce-scatter, unknown), in issue order."""
        return [a for a in self.collectives if a.kind in REDUCE_KINDS]


# rank-NNN.json's keys and how each is read; the first schema wrote all of REQUIRED
FIELDS = {
    "rank": int_, "world_size": int_, "status": optional(str_), "error": optional(str_),
    "points": list_of(Point.from_json), "allreduces": list_of(Collective.from_json),
    "unreduced_rows": list_of(UnreducedRow.from_json), "embed_module": optional(str_), "layers_hooked": int_,
    "coverage": lambda v, where: Coverage.from_json(v, where) if dict_(v, where) else None,   # {}: not said
    "aux": dict_, "params": dict_of(ParamHash.from_json),
    "timings": dict_, "device": str_, "hidden": optional(int_), "fingerprints": optional(dict_of(dict_)),
    "slot_match": optional(list_of(optional(str_))), "slot_fps": optional(dict_of(dict_)),
    "kept_bytes": optional(int_),
}
REQUIRED = ("rank", "world_size", "status", "error", "points", "allreduces", "unreduced_rows", "embed_module",
            "layers_hooked", "aux", "params", "timings", "device")


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
    params = replicated_param_hashes(model) if params is None else params
    return RankRecord(
        rank=rank, world_size=world, status=status, error=error,
        points=[Point.from_json(point_meta(n, tensors.get(n), tap.summaries.get(n)), f"point {n}")
                for n in dict.fromkeys(tap.order) if n in tensors or n in tap.summaries],
        collectives=[Collective.from_json(collective_meta(r, fingerprints is not None), f"collective #{r.seq}")
                     for r in tap.allreduces],
        unreduced_rows=[UnreducedRow.from_json(u) for u in tap.unreduced_rows()], embed_module=tap.embed_name,
        layers_hooked=len(tap.layer_indices),
        coverage=Coverage.from_json(tap.coverage(), "coverage") if with_coverage else None,
        aux=AuxLayout.from_json(aux_meta(aux), "aux") if aux is not None else None,
        params={n: ParamHash.from_json(e, f"parameter {n}") for n, e in params.items()}, timings=timings, device=device,
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


def resolve_summaries(tap, summarize, device_ok: bool) -> None:
    """The forward's deferred fingerprints, read in one copy (resolved on the side stream already,
    or dropped, when the device stayed blocked)."""
    if summarize is None:
        return
    summarize.resolve() if device_ok else summarize.drop()
    tap.summaries = {n: resolved(v) for n, v in tap.summaries.items() if resolved(v) is not None}
    for rec in tap.allreduces:
        rec.inp_summary, rec.out_summary = resolved(rec.inp_summary), resolved(rec.out_summary)
