"""The typed parts of a rank's record (rank-NNN.json), each read back by `from_json` and written by `to_json`.

A rank's record is written as a `RankRecord` (capture/record.py) and read back as one, so the checks read
fields, never strings. `from_json` validates: a field the first schema already wrote (`REQUIRED`) must be
present, every field present must have its type, and a ValueError names the one that is off
(formats/capture_dir.py turns it into the folder's load problem). Fields added later are optional with
defaults, so older capture folders still load. Keys a writer adds of its own are kept in `extra` and
written back in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

REDUCE_KINDS = ("all_reduce", "reduce_scatter", "unknown")    # collectives that sum partial results
Parse = Callable[[Any, str], Any]      # (JSON value, where it sits) -> the field's value, or ValueError


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _fail(where: str, want: str, v) -> ValueError:
    return ValueError(f"{where} must be {want}, not {_kind(v)}")


def any_(v, where: str):
    return v


def _of(want: str, ok: Callable[[object], bool]) -> Parse:
    """A parser that returns the value when `ok(value)`, else raises naming `want`."""
    def parse(v, where: str):
        if not ok(v):
            raise _fail(where, want, v)
        return v
    return parse


int_ = _of("an integer", lambda v: type(v) is int)        # not a bool
str_ = _of("a string", lambda v: isinstance(v, str))
bool_ = _of("true or false", lambda v: isinstance(v, bool))
dict_ = _of("an object", lambda v: isinstance(v, dict))
list_ = _of("a list", lambda v: isinstance(v, list))


def optional(parse: Parse) -> Parse:
    return lambda v, where: None if v is None else parse(v, where)


def list_of(parse: Parse) -> Parse:
    return lambda v, where: [parse(x, f"{where}[{i}]") for i, x in enumerate(list_(v, where))]


def dict_of(parse: Parse) -> Parse:
    return lambda v, where: {k: parse(x, f"{where}[{k!r}]") for k, x in dict_(v, where).items()}


def key(parse: Parse, default=None, json: Optional[str] = None, factory=None):
    """A field read from the JSON key `json` (default: the field's name) with `parse`."""
    meta = {"parse": parse, "json": json}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class JsonRecord:
    """A dataclass read from one JSON object: its fields declared with `key`, the rest kept in `extra`."""
    REQUIRED: tuple = ()       # JSON keys every writer wrote from the first schema on
    OPTIONAL: tuple = ()       # JSON keys written only when set (the others always, null included)

    @classmethod
    def _keys(cls) -> dict:
        return {f.metadata.get("json") or f.name: f for f in fields(cls) if "parse" in f.metadata}

    @classmethod
    def from_json(cls, obj, where: str = "the record"):
        obj = dict_(obj, where)
        keys = cls._keys()
        for k in cls.REQUIRED:
            if k not in obj:
                raise ValueError(f"{where} has no {k!r}")
        kw = {f.name: f.metadata["parse"](obj[k], f"{where}.{k}") for k, f in keys.items() if k in obj}
        return cls(**kw, extra={k: v for k, v in obj.items() if k not in keys})

    def to_json(self) -> dict:
        out = {}
        for k, f in self._keys().items():
            v = getattr(self, f.name)
            if v is not None or k not in self.OPTIONAL:
                out[k] = v.to_json() if isinstance(v, JsonRecord) else \
                    [x.to_json() if isinstance(x, JsonRecord) else x for x in v] if isinstance(v, list) else v
        return {**out, **self.extra}


@dataclass(frozen=True)
class Point(JsonRecord):
    """One capture point: its shape and dtype (the whole tensor's: a kept tensor may be a sample of its rows),
    and whether the tensor was kept (else only a fingerprint)."""
    REQUIRED = ("name", "shape", "dtype")
    name: str = key(str_)
    shape: list = key(list_of(int_), factory=list)
    dtype: str = key(str_, "?")
    kept: Optional[bool] = key(optional(bool_))
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Collective(JsonRecord):
    """One audited collective (JSON "allreduces"), as capture/audit/records.py's CollectiveRecord.meta()
    wrote it, with its input's and output's fingerprints when both were taken."""
    REQUIRED = ("seq", "module", "source", "layer", "where", "shape", "dtype", "group_size", "op")
    OPTIONAL = ("splits", "in_fp", "out_fp")
    seq: int = key(int_)
    module: Optional[str] = key(optional(str_))
    source: Optional[str] = key(optional(str_))           # the row-parallel module whose output it reduced
    layer: Optional[int] = key(optional(int_))            # its decoder layer, None outside the layers
    where: str = key(str_)                                # "embed" | "layer.K" | "other"
    shape: list = key(list_of(int_), factory=list)
    dtype: Optional[str] = key(optional(str_))
    group_size: int = key(int_)
    op: str = key(str_)
    kind: str = key(str_, "all_reduce")                   # all_reduce | reduce_scatter | all_gather | ...
    path: Optional[str] = key(optional(str_))             # the door it came through (None: not said)
    checked: bool = key(bool_, True)                      # False: its tensors could not be read
    group: Optional[str] = key(optional(str_))
    group_ranks: Optional[list] = key(optional(list_of(int_)))
    splits: Optional[list] = key(optional(list_))         # an all-to-all's [output splits, input splits]
    in_fp: Any = key(any_)                                # fingerprint JSON (a list of them per chunk)
    out_fp: Any = key(any_)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class UnreducedRow(JsonRecord):
    """A row-parallel module whose output no reduce followed."""
    REQUIRED = ("module", "layer")
    module: str = key(str_)
    layer: Optional[int] = key(optional(int_))
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AuxLayout(JsonRecord):
    """The whole packed aux tensor's layout (the kept tensor may be a sample of its rows)."""
    shape: Optional[list] = key(optional(list_of(int_)))
    dtype: Optional[str] = key(optional(str_))
    contiguous: Optional[bool] = key(optional(bool_))
    stride: Optional[list] = key(optional(list_of(int_)))
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ParamHash(JsonRecord):
    """A replicated parameter's hash (capture/params.py); `hash` None with `unreadable` saying why."""
    OPTIONAL = ("placements", "unreadable")
    layer: Optional[int] = key(optional(int_))
    replicated: Optional[bool] = key(optional(bool_), True)   # None: maybe a shard (a majority decides)
    placements: Optional[list] = key(optional(list_of(str_)))
    hash: Optional[str] = key(optional(str_))
    unreadable: Optional[str] = key(optional(str_))
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Coverage(JsonRecord):
    """What was hooked and audited on the rank (capture/hooks/tap.py's Tap.coverage)."""
    embed: Optional[str] = key(optional(str_))
    embed_how: Optional[str] = key(optional(str_))
    embed_layout: Optional[str] = key(optional(str_))
    placements: dict = key(dict_of(list_of(str_)), factory=dict)        # capture point -> DTensor placements
    row_placements: dict = key(dict_of(list_of(str_)), factory=dict)
    raised_in: Optional[str] = key(optional(str_))                      # where the forward raised
    unreadable_points: dict = key(dict_of(any_), factory=dict)          # capture point -> why not read
    layer_list: Optional[str] = key(optional(str_))
    layer_how: Optional[str] = key(optional(str_))
    layers_found: Optional[int] = key(optional(int_))
    layer_names: list = key(list_of(str_), factory=list)
    layers_ran: Optional[int] = key(optional(int_))
    layer_classes: Optional[list] = key(optional(list_of(str_)))
    reduces_per_place: dict = key(dict_, factory=dict)
    paths: dict = key(dict_, factory=dict)
    unreadable_paths: dict = key(dict_, factory=dict)
    audit: Any = key(any_)
    audit_path: Optional[str] = key(optional(str_))
    extra: dict = field(default_factory=dict)
