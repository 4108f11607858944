"""Loading one side of a diff: a capture folder, a rank file, a SpecForge sample or a bare packed
tensor, as a `Side` (the packed [tokens, K*hidden] tensor, its input_ids and residual streams), and
cutting it into slots. Nothing is executed: safetensors, or torch.load(weights_only=True)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ...capture.points import AUX_PACKED, EMBED_OUT, in_norm, layer_streams
from ...core.errors import CaptureError, UsageError
from ...formats.specforge import EXPECTED, parse_sample, safe_torch_load
from ...formats.vllm_hidden import is_vllm_hidden
from ...formats.vllm_hidden import parse as parse_vllm

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".gz")


@dataclass
class Side:
    role: str
    path: Path
    kind: str                                   # capture | rank-file | specforge | vllm-extract | bare
    packed: torch.Tensor                        # [tokens, K*hidden]
    input_ids: Optional[torch.Tensor] = None
    streams: dict[str, torch.Tensor] = field(default_factory=dict)   # embed.out, layer.0.in_norm, layer.K.out
    hidden: Optional[int] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None
    layer_ids: Optional[list[int]] = None
    num_layers: Optional[int] = None
    slots: list[torch.Tensor] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def describe(self) -> dict:
        d = {"path": str(self.path), "kind": self.kind, "dtype": str(self.dtype).replace("torch.", ""),
             "tokens": int(self.packed.shape[0]), "slots": len(self.slots), "hidden": self.hidden,
             "has_input_ids": self.input_ids is not None, "streams": len(self.streams)}
        for k in ("rank", "world_size", "layer_ids", "num_layers"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    def text(self) -> str:
        bits = [self.kind.replace("-", " ")]
        if self.rank is not None:
            bits.append(f"rank {self.rank}" + (f" of tp {self.world_size}" if self.world_size else ""))
        bits.append(str(self.dtype).replace("torch.", ""))
        bits.append(f"{len(self.slots)} slots × {self.hidden}")
        if self.layer_ids is not None:
            bits.append(f"ids {self.layer_ids}")
        if self.streams:
            outs = len(layer_streams(self.streams))
            parts = (["the embedding"] if EMBED_OUT in self.streams else []) + [f"{outs} layer outputs"] \
                + (["layer 0's input norm"] if in_norm(0) in self.streams else [])
            bits.append("streams: " + ", ".join(parts))
        return f"{self.path} ({', '.join(bits)})"


# ---- loading ---------------------------------------------------------------------------------
def _packed2d(path: Path, what: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise CaptureError(f"{path}: {what} is {getattr(t, 'dtype', type(t).__name__)}, expected a float "
                           f"packed [tokens, K*hidden] tensor")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise CaptureError(f"{path}: {what} has shape {list(t.shape)}, expected a packed [tokens, K*hidden] "
                           f"tensor (or [1, tokens, K*hidden])")
    return t


def _from_rank_tensors(role, path, kind, tensors: dict, hidden=None, **kw) -> Side:
    if AUX_PACKED not in tensors:
        raise CaptureError(f"{path}: no {AUX_PACKED!r} tensor; expected a capture taken with EAGLE-3 layer ids "
                           f"(tpprobe probe --layers, or the SGLang plugin with an EAGLE-3 draft)")
    streams = {n: tensors[n] for n in [EMBED_OUT, in_norm(0)] + layer_streams(tensors) if n in tensors}
    if hidden is None and EMBED_OUT in tensors:
        hidden = int(tensors[EMBED_OUT].shape[-1])
    return Side(role, path, kind, _packed2d(path, AUX_PACKED, tensors[AUX_PACKED]),
                input_ids=tensors.get("input_ids"), streams=streams, hidden=hidden, **kw)


def _load_capture(role: str, path: Path, rank: int) -> Side:
    from ...formats.capture_dir import load_run
    run = load_run(path)
    return side_of_run(role, run, rank)


def side_of_run(role, run, rank) -> Side:
    path = run.path
    bad = [p for p in run.problems if p["rank"] == rank and "extra" not in p["problem"]]
    if bad:
        raise CaptureError(f"{path / bad[0]['file']}: {bad[0]['problem']}; expected a verified capture file")
    if rank not in run.records:
        raise CaptureError(f"{path}: rank {rank} is not in this capture (readable ranks: {sorted(run.records)}); "
                           f"choose one with --rank")
    s = run.manifest.get("settings") or {}
    return _from_rank_tensors(role, path, "capture", run.records[rank].tensors, hidden=s.get("hidden"),
                              rank=rank, world_size=run.manifest.get("world_size"),
                              layer_ids=s.get("layer_ids"), num_layers=s.get("num_layers"))


def _load_file(role: str, path: Path) -> Side:
    suf = path.name.lower()
    head = path.open("rb").read(8)
    if suf.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CaptureError(f"{path}: not a readable safetensors file ({str(e)[:120]}); expected {EXPECTED}")
        if AUX_PACKED in t:
            return _from_rank_tensors(role, path, "rank-file", t)
        if "aux_hidden_state" in t:
            return _from_sample(role, path, parse_sample(path, t))
        if is_vllm_hidden(t):
            v = parse_vllm(path, t)
            return Side(role, path, "vllm-extract", v["packed"], input_ids=v["input_ids"], hidden=v["hidden"])
        if len(t) == 1:
            return Side(role, path, "bare", _packed2d(path, f"tensor {next(iter(t))!r}", next(iter(t.values()))))
        raise CaptureError(f"{path}: holds {len(t)} tensors ({', '.join(list(t)[:6])}), expected {EXPECTED}")
    if suf.endswith(TORCH_SUFFIXES) or head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        data = safe_torch_load(path)
        if isinstance(data, torch.Tensor):
            return Side(role, path, "bare", _packed2d(path, "the tensor", data))
        if isinstance(data, dict) and any(k in data for k in ("aux_hidden_state", "hidden_state", "input_ids")):
            return _from_sample(role, path, parse_sample(path, data))
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), torch.Tensor):
            k, v = next(iter(data.items()))
            return Side(role, path, "bare", _packed2d(path, f"tensor {k!r}", v))
        what = f"a dict with keys {list(data)[:6]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise CaptureError(f"{path}: holds {what}; expected {EXPECTED}")
    raise CaptureError(f"{path}: unknown file type; expected a tpprobe capture folder, {EXPECTED} "
                       f"(.ckpt/.pt/.safetensors)")


def _from_sample(role, path, s: dict) -> Side:
    hidden = int(s["hidden_state"].shape[-1]) if "hidden_state" in s else None
    return Side(role, path, "specforge", s["aux_hidden_state"], input_ids=s.get("input_ids"), hidden=hidden)


def load_side(role: str, path, rank: int = 0) -> Side:
    path = Path(path)
    if not path.exists():
        raise CaptureError(f"{path}: no such file or folder; expected a tpprobe capture folder or {EXPECTED}")
    if path.is_dir():
        return _load_capture(role, path, rank)
    return _load_file(role, path)


def split_slots(side: Side, hidden: Optional[int], slots: Optional[int], other: Optional[Side]) -> None:
    """Cut the packed tensor into slots: --hidden, the side's own hidden size, the other side's,
    or --slots, in that order."""
    W = int(side.packed.shape[-1])
    h, why = None, ""
    if hidden:
        h, why = hidden, "--hidden"
    elif side.hidden:
        h, why = side.hidden, "its hidden size"
    elif slots:
        if W % slots:
            raise UsageError(f"{side.path}: packed width {W} is not divisible by --slots {slots}")
        h, why = W // slots, "--slots"
    elif other is not None and other.hidden:
        h, why = other.hidden, f"the {other.role}'s hidden size"
    if not h:
        raise UsageError(f"{side.path}: a packed [tokens, {W}] tensor with no hidden size: pass --slots K "
                         f"or --hidden H to split it")
    if W % h:
        raise CaptureError(f"{side.path}: packed width {W} is not a multiple of hidden {h} ({why}); "
                           f"expected [tokens, K*{h}]")
    side.hidden = h
    side.slots = list(side.packed.split(h, dim=-1))
