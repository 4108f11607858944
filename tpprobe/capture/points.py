"""The capture-point registry: every name a rank records, as a typed `Point` (name, kind, layer, slot).

    embed.local       the embedding's own share before its all-reduce (kind "share", layer -1)
    embed.out         the embedding after its all-reduce              (kind "stream", layer -1)
    layer.K.out       decoder layer K's residual stream               (kind "stream", layer K)
    layer.K.in_norm   decoder layer K's input-norm output             (kind "in_norm", layer K)
    aux.packed        the model's packed EAGLE-3 aux hidden state     (kind "aux")
    allreduce.N.in    the input / output of the N-th audited all-reduce (kind "allreduce_in" / "allreduce_out", seq N)
    input_ids         the tokens                                       (kind "input_ids")

Names are made here (`layer_out(k)`, `allreduce_in(n)`, `id_point(layer_id)`, `layer_place(k)`) and
read here (`parse(name)`, `point_layer`, `place_layer`); no other module splits or spells a
capture-point name: they use the constants and helpers below. The string stays the on-disk key
(rank-NNN.safetensors, rank-NNN.json), so capture folders are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Optional

EMBED_OUT = "embed.out"
EMBED_LOCAL = "embed.local"
AUX_PACKED = "aux.packed"
INPUT_IDS = "input_ids"
EMBED_PLACE = "embed"        # an all-reduce place (`layer_place`), not a capture point

STREAM, SHARE, IN_NORM, AUX, AR_IN, AR_OUT, TOKENS, OTHER = (
    "stream", "share", "in_norm", "aux", "allreduce_in", "allreduce_out", "input_ids", "other")


@dataclass(frozen=True)
class Point:
    name: str
    kind: str                       # one of the kinds above
    layer: Optional[int] = None     # -1 = the embedding, K = decoder layer K, None = neither
    slot: Optional[int] = None      # the aux slot it is expected in (`expected_points`), else None
    seq: Optional[int] = None       # the all-reduce's sequence number (allreduce.N.*)

    def __str__(self) -> str:
        return self.name

    @property
    def is_stream(self) -> bool:
        """On the residual stream (embed.out, layer.K.out): equal on every rank after each reduce."""
        return self.kind == STREAM

    @property
    def position(self) -> Optional[float]:
        """Where it sits in model order: the embedding -1, layer 0's input norm -0.5, layer K K."""
        if self.kind == IN_NORM and self.layer is not None:
            return self.layer - 0.5
        return float(self.layer) if self.layer is not None else None


def _int(s: str) -> Optional[int]:
    return int(s) if s.lstrip("-").isdigit() else None


@lru_cache(maxsize=4096)     # process-wide by nature: a pure function of the name (Point is frozen)
def parse(name: str) -> Point:
    """The one reader of capture-point names."""
    if name == EMBED_OUT:
        return Point(name, STREAM, -1)
    if name == EMBED_LOCAL:
        return Point(name, SHARE, -1)
    if name == AUX_PACKED:
        return Point(name, AUX)
    if name == INPUT_IDS:
        return Point(name, TOKENS)
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layer" and _int(parts[1]) is not None:
        kind = {"out": STREAM, "in_norm": IN_NORM}.get(parts[2], OTHER)
        return Point(name, kind, _int(parts[1]))
    if len(parts) == 3 and parts[0] == "allreduce" and _int(parts[1]) is not None and parts[2] in ("in", "out"):
        return Point(name, AR_IN if parts[2] == "in" else AR_OUT, seq=_int(parts[1]))
    if parts[0] == "layer" and len(parts) > 1 and _int(parts[1]) is not None:
        return Point(name, OTHER, _int(parts[1]))
    return Point(name, OTHER, -1 if name.startswith("embed") else None)


# ---- making names --------------------------------------------------------------------------------
def layer_out(k: int) -> str:
    return f"layer.{k}.out"


def in_norm(k: int) -> str:
    return f"layer.{k}.in_norm"


def allreduce_in(seq: int) -> str:
    return f"allreduce.{seq}.in"


def allreduce_out(seq: int) -> str:
    return f"allreduce.{seq}.out"


def layer_place(layer: Optional[int]) -> str:
    """The `where` of an all-reduce record: "embed", "layer.K" or "other"."""
    if layer == -1:
        return EMBED_PLACE
    return f"layer.{layer}" if layer is not None else "other"


def place_layer(where) -> Optional[int]:
    """The layer of an all-reduce place (`layer_place`'s inverse): "embed" -1, "layer.K" K, else None."""
    if where == EMBED_PLACE:
        return -1
    parts = str(where).split(".")
    return _int(parts[1]) if len(parts) == 2 and parts[0] == "layer" else None


def is_layer_place(where) -> bool:
    """A decoder layer's place ("layer.K"), not the embedding's or another."""
    k = place_layer(where)
    return k is not None and k >= 0


def id_point(layer_id: int) -> str:
    """The point an EAGLE-3 layer id names in tpprobe's convention (-1 = the embedding)."""
    return EMBED_OUT if layer_id == -1 else layer_out(layer_id)


def expected_points(ids: Iterable[int]) -> list[Point]:
    """The point each aux slot must hold for these layer ids (slot i <- id i)."""
    return [Point(p.name, p.kind, p.layer, slot=i) for i, p in enumerate(parse(id_point(x)) for x in ids)]


# ---- reading names -------------------------------------------------------------------------------
def point_layer(name: str) -> Optional[int]:
    return parse(name).layer


def point_position(name: Optional[str]) -> Optional[float]:
    """Where a point sits in model order (`Point.position`); None for no point."""
    return parse(name).position if name else None


def decoder_layer(name: str) -> Optional[int]:
    """The decoder layer a point belongs to (layer.K.*: K); None for the embedding and the rest."""
    k = parse(name).layer
    return k if k is not None and k >= 0 else None


def point_label(name: str) -> str:
    p = parse(name)
    if name == EMBED_OUT:
        return "the embedding"
    if name == EMBED_LOCAL:
        return "the embedding's local (pre-reduce) output"
    if p.kind == IN_NORM:
        return f"layer {p.layer}'s input norm output"
    return f"layer {p.layer}'s output" if p.layer is not None else name


def point_short(name: Optional[str]) -> str:
    """A table cell's name for a point: "embedding", "layer K", "layer K input norm" ("?" for none)."""
    if name is None:
        return "?"
    p = parse(name)
    if name == EMBED_OUT:
        return "embedding"
    if p.kind == SHARE:
        return "embedding share"
    if p.kind == IN_NORM:
        return f"layer {p.layer} input norm"
    return f"layer {p.layer}" if p.layer is not None else name


def stream_order(names) -> list[str]:
    """embed.out, then layer.K.out in K order (the residual stream in model order)."""
    layers = sorted((parse(n).layer, n) for n in names if parse(n).is_stream and n != EMBED_OUT)
    return ([EMBED_OUT] if EMBED_OUT in names else []) + [n for _, n in layers]


def layer_streams(names) -> list[str]:
    """layer.K.out in K order (no embedding)."""
    return [n for n in stream_order(names) if n != EMBED_OUT]


def kept_beside_fingerprints(layer_ids) -> Callable[[str], bool]:
    """With --exchange fingerprint, the points a rank still keeps as tensors: the ids' points, the
    embedding and the input norms (the slot candidates), so slots can be matched on the rank."""
    keep_ids = {id_point(i) for i in layer_ids}
    return lambda n: n in keep_ids or parse(n).layer == -1 or parse(n).kind == IN_NORM
