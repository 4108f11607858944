"""`tpprobe diff BASELINE TARGET`: two runs of the same tokens, slot by slot, with a slot matcher.

BASELINE and TARGET are each a tpprobe capture folder, a SpecForge EAGLE-3 sample (`.ckpt`,
`.ckpt.gz`, `.pt`, loaded with `torch.load(weights_only=True)` only), a tpprobe rank file, or a
bare `.safetensors` / `.pt` holding one packed [tokens, K*hidden] tensor.

  align   tokens by input_ids: exact, prefix, or a stated --offset; different sequences are refused
  pair    every target slot against every baseline slot (rel diff, float64); where a side is a
          capture with the residual stream of every layer, every slot of both sides is also named
          by the stream (or the embedding) it equals
  report  per slot: rel diff, max/mean abs, cosine, ULP, worst token (a bf16 side against a
          float32 side: both as stored and with the float32 side rounded to bf16), and one line
          naming the mapping. Exit 0 when target slot j equals baseline slot j for every j within
          its threshold, 1 otherwise, 2 for unreadable input.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from ..checks.slots import slot_verdict
from ..capture.points import point_label, point_layer, stream_order
from ..checks.noise import coarser, compare
from ..errors import CaptureError, TPProbeError, UsageError
from .specforge import EXPECTED, parse_sample, safe_torch_load

SCHEMA = "tpprobe.diff/1"
FINE = (torch.float32, torch.float64)
DEFAULT_THRESHOLD = {"fine": 1e-5, "coarse": 2e-3}   # rel diff: fp32 both sides / any bf16 or fp16 side
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".gz")


@dataclass
class Side:
    role: str
    path: Path
    kind: str                                   # capture | rank-file | specforge | bare
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
            bits.append(f"{len(self.streams)} residual streams")
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
    if "aux.packed" not in tensors:
        raise CaptureError(f"{path}: no 'aux.packed' tensor; expected a capture taken with EAGLE-3 layer ids "
                           f"(tpprobe probe --layers, or the SGLang plugin with an EAGLE-3 draft)")
    streams = {n: tensors[n] for n in ["embed.out", "layer.0.in_norm"] + stream_order(tensors)[1:] if n in tensors}
    if hidden is None and "embed.out" in tensors:
        hidden = int(tensors["embed.out"].shape[-1])
    return Side(role, path, kind, _packed2d(path, "aux.packed", tensors["aux.packed"]),
                input_ids=tensors.get("input_ids"), streams=streams, hidden=hidden, **kw)


def _load_capture(role: str, path: Path, rank: int) -> Side:
    from ..capture.files import load_run
    run = load_run(path)
    return _side_of_run(role, run, rank)


def _side_of_run(role, run, rank) -> Side:
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
        if "aux.packed" in t:
            return _from_rank_tensors(role, path, "rank-file", t)
        if "aux_hidden_state" in t:
            return _from_sample(role, path, parse_sample(path, t))
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


# ---- token alignment -------------------------------------------------------------------------
def align(b: Side, t: Side, offset: Optional[int]) -> dict:
    """Token ranges to compare: baseline[b0:b0+n] against target[t0:t0+n].
    offset: target token i is baseline token i + offset (negative: the target starts earlier)."""
    nb, nt = int(b.packed.shape[0]), int(t.packed.shape[0])
    b0, t0 = (offset, 0) if (offset or 0) >= 0 else (0, -offset)
    b0, t0 = (b0 or 0), (t0 or 0)
    n = min(nb - b0, nt - t0)
    if n <= 0:
        raise UsageError(f"--offset {offset} leaves no common tokens (baseline {nb}, target {nt})")
    if b.input_ids is None or t.input_ids is None:
        side = b if b.input_ids is None else t
        if offset is None and nb != nt:
            raise UsageError(f"{side.path} has no input_ids and the token counts differ (baseline {nb}, target "
                             f"{nt}): pass --offset N to say how they line up")
        return {"mode": "offset" if offset else "position", "offset": offset or 0, "tokens": n,
                "baseline_start": b0, "target_start": t0,
                "note": f"{side.role} has no input_ids: tokens aligned by position, not checked"}
    bi, ti = b.input_ids.reshape(-1).long(), t.input_ids.reshape(-1).long()
    if bi.numel() != nb or ti.numel() != nt:
        s = b if bi.numel() != nb else t
        raise CaptureError(f"{s.path}: {s.input_ids.numel()} input_ids but {s.packed.shape[0]} token rows")
    a, c = bi[b0:b0 + n], ti[t0:t0 + n]
    diff = (a != c).nonzero()
    if diff.numel():
        k = int(diff[0, 0])
        hint = "" if offset is not None else _offset_hint(bi, ti)
        raise UsageError(f"the token sequences differ: baseline token {b0 + k} is id {int(a[k])}, target token "
                         f"{t0 + k} is id {int(c[k])} (first difference of {n} compared{hint}); "
                         f"refusing to compare different sequences")
    mode = "offset" if offset else ("exact" if nb == nt else "prefix")
    note = {"exact": f"input_ids identical ({n} tokens)",
            "prefix": f"{'target' if nt < nb else 'baseline'} is a prefix of the "
                      f"{'baseline' if nt < nb else 'target'}: the first {n} tokens compared",
            "offset": f"target token i = baseline token i{offset or 0:+d}: {n} tokens compared"}[mode]
    return {"mode": mode, "offset": offset or 0, "tokens": n, "baseline_start": b0, "target_start": t0, "note": note}


def _offset_hint(bi, ti) -> str:
    short, long_, sign = (ti, bi, 1) if ti.numel() <= bi.numel() else (bi, ti, -1)
    m = min(short.numel(), 8)
    for off in range(1, long_.numel() - m + 1):
        if torch.equal(long_[off:off + m], short[:m]) and torch.equal(
                long_[off:off + short.numel()], short[:long_.numel() - off]):
            return f"; the target's ids appear at baseline offset {sign * off}: pass --offset {sign * off}"
    return ""


# ---- numbers ---------------------------------------------------------------------------------
def _common(x: torch.Tensor, y: torch.Tensor):
    """Both sides in the coarser float dtype (the finer side rounded), as the matcher sees them."""
    if x.dtype != y.dtype and x.dtype.is_floating_point and y.dtype.is_floating_point:
        lo = coarser(x.dtype, y.dtype)
        return x.to(lo), y.to(lo)
    return x, y


def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2Σxy/(Σx²+Σy²) in float64 (0: equal; 1: orthogonal; 2: opposite)."""
    if x.shape != y.shape:
        return math.inf
    x, y = _common(x, y)
    a, b = x.double(), y.double()
    sxx, syy = float((a * a).sum()), float((b * b).sum())
    if not (math.isfinite(sxx) and math.isfinite(syy)):
        return math.inf
    return 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * float((a * b).sum()) / (sxx + syy))


def _stats(x: torch.Tensor, y: torch.Tensor, judge: Optional[torch.dtype] = None) -> dict:
    c = compare(x, y, dtype=judge)
    if c["level"] == "shape":
        return {"level": "shape", "shape": c["shape"], "ref_shape": c["ref_shape"], "rel_diff": math.inf}
    a, b = x.double().reshape(x.shape[0], -1), y.double().reshape(y.shape[0], -1)
    both = torch.isfinite(a) & torch.isfinite(b)
    a0, b0 = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    den = math.sqrt(float((a0 * a0).sum()) * float((b0 * b0).sum()))
    per_tok = (a0 - b0).abs().amax(-1)
    worst = int(per_tok.argmax()) if per_tok.numel() and float(per_tok.max()) > 0 else None
    return {"level": c["level"], "rel_diff": c["rel_diff"], "max_abs": c["max_abs"], "mean_abs": c["mean_abs"],
            "cosine": float((a0 * b0).sum()) / den if den > 0 else (1.0 if float(a0.abs().sum() + b0.abs().sum()) == 0 else 0.0),
            "ulp_max": c["ulp_max"], "ulp_mean": c["ulp_mean"], "worst_token": worst,
            "first_material_token": c["first_token"], "nan_mismatch": c["nan_mismatch"],
            "judged_in": str(judge or coarser(x.dtype, y.dtype)).replace("torch.", "")}


def pair_stats(x: torch.Tensor, y: torch.Tensor) -> dict:
    """Target slot x against baseline slot y. Mixed precision: the main numbers are taken after
    rounding the finer side to the coarser dtype; `as_stored` keeps the unrounded comparison."""
    if x.dtype != y.dtype and x.dtype.is_floating_point and y.dtype.is_floating_point:
        lo = coarser(x.dtype, y.dtype)
        s = _stats(*_common(x, y))
        s["rounded_to"] = str(lo).replace("torch.", "")
        s["as_stored"] = _stats(x, y, judge=lo)
        return s
    return _stats(x, y)


# ---- thresholds ------------------------------------------------------------------------------
def default_threshold(b: Side, t: Side) -> float:
    return DEFAULT_THRESHOLD["fine" if b.dtype in FINE and t.dtype in FINE else "coarse"]


def parse_thresholds(text: Optional[str], n_slots: int, default: float) -> list[float]:
    """'1e-3' (every slot) or '0=1e-3,2=5e-2' (per target slot; a bare value sets the rest)."""
    out: dict[int, float] = {}
    if text:
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            k, eq, v = item.rpartition("=")
            try:
                val = float(v)
                if not math.isfinite(val) or val < 0:
                    raise ValueError
            except ValueError:
                raise UsageError(f"--threshold {text!r}: {v!r} is not a non-negative number; use 1e-3 or 0=1e-3,2=5e-2")
            if not eq:
                default = val
                continue
            try:
                j = int(k)
            except ValueError:
                raise UsageError(f"--threshold {text!r}: {k!r} is not a slot index; use 0=1e-3,2=5e-2")
            if not 0 <= j < n_slots:
                raise UsageError(f"--threshold {text!r}: slot {j} does not exist (the target has {n_slots} slots)")
            out[j] = val
    return [out.get(j, default) for j in range(n_slots)]


# ---- the matcher -----------------------------------------------------------------------------
def _label(p: Optional[str]) -> str:
    return point_label(p) if p else "nothing recognisable"


def _short(p: Optional[str]) -> str:
    if p is None:
        return "?"
    if p == "embed.out":
        return "embedding"
    if p == "layer.0.in_norm":
        return "layer 0 input norm"
    return f"layer {point_layer(p)}" if point_layer(p) is not None else p


def identify(slots: list[torch.Tensor], streams: dict[str, torch.Tensor], thr: float) -> list[dict]:
    """Each slot's nearest residual stream (or the embedding), named when within thr."""
    out = []
    for s in slots:
        best, br = None, math.inf
        for n, c in streams.items():
            r = rel_diff(s, c)
            if r < br:
                best, br = n, r
        out.append({"point": best if br <= thr else None, "nearest": best,
                    "rel_diff": br if math.isfinite(br) else None})
    return out


def _stream_view(side: Side, sl: slice) -> dict[str, torch.Tensor]:
    return {n: t[sl] for n, t in side.streams.items()}


def diff_sides(b: Side, t: Side, al: dict, thresholds: list[float], id_thr: float) -> dict:
    bs = slice(al["baseline_start"], al["baseline_start"] + al["tokens"])
    ts = slice(al["target_start"], al["target_start"] + al["tokens"])
    B = [s[bs] for s in b.slots]
    T = [s[ts] for s in t.slots]
    nb, nt = len(B), len(T)
    M = [[rel_diff(T[j], B[i]) for i in range(nb)] for j in range(nt)]
    match: list[Optional[int]] = []
    for j in range(nt):
        if not nb:
            match.append(None)
            continue
        i = min(range(nb), key=lambda i: (M[j][i], i != j))
        if j < nb and M[j][j] <= thresholds[j]:
            i = j                                   # in place wins ties (duplicated slots)
        match.append(i if M[j][i] <= thresholds[j] else None)

    # name each slot by a residual stream: its own side's streams first, else the other side's
    streams_src = None
    tid = bid = None
    if t.streams or b.streams:
        tsrc = (_stream_view(t, ts), "target") if t.streams else (_stream_view(b, bs), "baseline")
        bsrc = (_stream_view(b, bs), "baseline") if b.streams else (_stream_view(t, ts), "target")
        tid = identify(T, tsrc[0], id_thr)
        bid = identify(B, bsrc[0], id_thr)
        streams_src = {"target": tsrc[1], "baseline": bsrc[1]}
    tp = [x["point"] for x in tid] if tid else [None] * nt
    bp = [x["point"] for x in bid] if bid else [None] * nb

    rows = []
    un_b = [i for i in range(nb) if i not in match]
    un_t = [j for j in range(nt) if match[j] is None]
    counterpart = {j: (j if j in un_b else None) for j in un_t}
    rest_b = [i for i in un_b if i not in counterpart.values()]
    for j in [j for j in un_t if counterpart[j] is None]:
        counterpart[j] = rest_b.pop(0) if rest_b else None
    for j in range(nt):
        i = match[j] if match[j] is not None else counterpart.get(j)
        if i is None and nb:
            i = min(range(nb), key=lambda i: M[j][i])
        st = pair_stats(T[j], B[i]) if i is not None else {}
        rows.append({"target_slot": j, "baseline_slot": i, "target_holds": tp[j],
                     "baseline_holds": bp[i] if i is not None else None, "matched": match[j] is not None,
                     "in_place": match[j] == j, "threshold": thresholds[j], **st})

    ok = nt == nb and all(match[j] == j for j in range(nt))
    verdict, kinds = _verdict(match, M, thresholds, tp, bp, nb, nt, ok)
    cause = None
    if not ok and bid and tid and all(bp) and all(tp):
        v = slot_verdict([point_layer(p) for p in bp], bp, tp, max(b.num_layers or 0, t.num_layers or 0) or None)
        if v is not None:
            cause = {"kind": v[0], "where": v[1], "detail": v[2]}
    return {"ok": ok, "verdict": verdict, "kinds": kinds, "cause": cause, "match": match,
            "rel_matrix": [[(x if math.isfinite(x) else None) for x in r] for r in M],
            "identity": {"target": tid, "baseline": bid, "streams_from": streams_src},
            "rows": rows}


def _verdict(match, M, thr, tp, bp, nb, nt, ok) -> tuple[str, list[str]]:
    def bl(i):
        return f"baseline slot {i}" + (f" ({_label(bp[i])})" if bp[i] else "")

    if ok:
        worst = max((M[j][j] for j in range(nt)), default=0.0)
        names = ", ".join(f"{j} = {_short(tp[j] or bp[j])}" for j in range(nt)) if any(tp) or any(bp) else ""
        return (f"MATCH: all {nt} target slots equal the baseline's in place (max rel diff {worst:.2e})"
                + (f": slots {names}" if names else ""), ["match"])
    kinds: list[str] = []
    parts: list[str] = []
    matched = [j for j in range(nt) if match[j] is not None]
    un_b = [i for i in range(nb) if i not in match]
    un_t = [j for j in range(nt) if match[j] is None]
    if nt == nb and not un_t and sorted(match) == list(range(nb)):
        kinds.append("permuted")
        parts.append("slots are permuted")
    elif matched and all(match[j] - j == match[matched[0]] - matched[0] for j in matched) \
            and match[matched[0]] != matched[0]:
        d = match[matched[0]] - matched[0]
        kinds.append("shifted")
        parts.append(f"slots are shifted by {abs(d)} position{'s' if abs(d) > 1 else ''} "
                     f"(target slot j = baseline slot j{d:+d})")
    dup = [i for i in set(m for m in match if m is not None) if match.count(i) > 1]
    if dup:
        kinds.append("duplicated")
    for j in range(nt):
        if match[j] is not None:
            if match[j] != j or (dup and match[j] in dup):
                parts.append(f"target slot {j} = {bl(match[j])}")
    pair = {}
    rest_b = list(un_b)
    for j in un_t:
        if j in rest_b:
            pair[j] = j
            rest_b.remove(j)
    for j in un_t:
        if j not in pair and rest_b:
            pair[j] = rest_b.pop(0)
    named = set()
    for j in un_t:
        e = pair.get(j)
        txt = f"target slot {j} has no match"
        if tp[j] and e is not None and bp[e]:
            txt += f": {_label(tp[j])} was captured where {_label(bp[e])} (baseline slot {e}) was expected"
            lt, lb = _pos(tp[j]), _pos(bp[e])
            if lt is not None and lb is not None and abs(lt - lb) == 1:
                txt += f", one layer {'early' if lt < lb else 'late'} (off by one)"
                kinds.append("off-by-one")
                named.add(e)
            else:
                kinds.append("wrong-layer")
        elif tp[j]:
            txt += f": it holds {_label(tp[j])}" + (f", expected {bl(e)}" if e is not None else
                                                    ", which the baseline does not carry")
            kinds.append("wrong-layer" if e is not None else "extra-slot")
        else:
            near = min(range(nb), key=lambda i: M[j][i]) if nb else None
            txt += (f" (closest: baseline slot {near}, rel diff {M[j][near]:.2e} > threshold {thr[j]:.0e})"
                    if near is not None else "")
            if e is not None and e != near:
                txt += f"; expected {bl(e)}"
            kinds.append("no-match")
        parts.append(txt)
    for i in un_b:
        if i in pair.values():
            if bp[i] and bp[i] not in tp and i not in named:
                parts.append(f"{_label(bp[i])} is missing from the target")
                kinds.append("missing-slot")
            continue
        parts.append(f"{bl(i)} is missing from the target")
        kinds.append("missing-slot")
    if nt != nb:
        parts.append(f"the target has {nt} slots, the baseline {nb}")
        kinds.append("slot-count")
    if not kinds:
        kinds.append("mismatch")
    return "MISMATCH: " + "; ".join(parts), sorted(set(kinds), key=kinds.index)


def _pos(p):
    if p == "layer.0.in_norm":
        return -0.5
    return point_layer(p) if p else None


# ---- running it ------------------------------------------------------------------------------
def run_diff(baseline, target, rank: int = 0, all_ranks: bool = False, slots: Optional[int] = None,
             hidden: Optional[int] = None, offset: Optional[int] = None,
             threshold: Optional[str] = None) -> dict:
    if slots is not None and slots < 1:
        raise UsageError(f"--slots must be >= 1 (got {slots})")
    if hidden is not None and hidden < 1:
        raise UsageError(f"--hidden must be >= 1 (got {hidden})")
    pairs = _rank_pairs(Path(baseline), Path(target), rank, all_ranks)
    results = []
    for b, t in pairs:
        split_slots(b, hidden, slots, t)
        split_slots(t, hidden, slots, b)
        if b.hidden != t.hidden:
            raise UsageError(f"slot widths differ: baseline {b.path} has hidden {b.hidden}, target {t.path} "
                             f"{t.hidden}; these are captures of different models (or pass --hidden)")
        al = align(b, t, offset)
        default = default_threshold(b, t)
        thr = parse_thresholds(threshold, len(t.slots), default)
        res = diff_sides(b, t, al, thr, max(thr + [default]))
        res.update(baseline=b.describe(), target=t.describe(), alignment=al, thresholds=thr,
                   default_threshold=default, baseline_text=b.text(), target_text=t.text())
        results.append(res)
    ok = all(r["ok"] for r in results)
    return {"schema": SCHEMA, "ok": ok, "exit_code": 0 if ok else 1, "results": results}


def _rank_pairs(bp: Path, tp: Path, rank: int, all_ranks: bool) -> list[tuple[Side, Side]]:
    if not all_ranks:
        return [(load_side("baseline", bp, rank), load_side("target", tp, rank))]
    from ..capture.files import load_run
    runs = {p: load_run(p) for p in (bp, tp) if p.is_dir()}
    if not runs:
        raise UsageError("--all-ranks needs at least one capture folder (both are files)")
    if tp in runs:
        t_ranks = sorted(runs[tp].records) or [rank]
    else:
        t_ranks = None
    b_ranks = sorted(runs[bp].records) if bp in runs else None
    out = []
    for r in (t_ranks or b_ranks):
        t = _side_of_run("target", runs[tp], r) if tp in runs else load_side("target", tp)
        if bp in runs:
            br = r if r in runs[bp].records else rank
            b = _side_of_run("baseline", runs[bp], br)
        else:
            b = load_side("baseline", bp)
        out.append((b, t))
    return out


# ---- rendering -------------------------------------------------------------------------------
def _f(x, fmt=".2e") -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf"
    return format(x, fmt)


def render(rep: dict, console) -> None:
    from rich.table import Table
    from rich.text import Text
    for res in rep["results"]:
        console.print(Text(f"baseline: {res['baseline_text']}", style="dim"))
        console.print(Text(f"target:   {res['target_text']}", style="dim"))
        console.print(Text(f"tokens:   {res['alignment']['mode']}: {res['alignment']['note']}", style="dim"))
        mixed = any("as_stored" in r for r in res["rows"])
        tab = Table(pad_edge=False)
        for col in ["t→b", "target", "baseline", "rel diff"] + (["as stored"] if mixed else []) + \
                   ["abs max/mean", "cosine", "ULP max/mean", "worst", "thr", ""]:
            tab.add_column(col, justify="left" if col in ("target", "baseline", "") else "right", no_wrap=True)
        for r in res["rows"]:
            status = ("match" if r["in_place"] else f"= b{r['baseline_slot']}") if r["matched"] else "NO MATCH"
            style = "green" if r["in_place"] else ("yellow" if r["matched"] else "bold red")
            tab.add_row(f"{r['target_slot']}→{'–' if r['baseline_slot'] is None else r['baseline_slot']}",
                        _short(r["target_holds"]) if r["target_holds"] else "?",
                        _short(r["baseline_holds"]) if r["baseline_holds"] else "?",
                        _f(r.get("rel_diff"), ".1e"),
                        *([_f(r["as_stored"]["rel_diff"], ".1e") if "as_stored" in r else ""] if mixed else []),
                        f"{_f(r.get('max_abs'), '.2g')}/{_f(r.get('mean_abs'), '.2g')}", _f(r.get("cosine"), ".5f"),
                        f"{_f(r.get('ulp_max'), '.3g')}/{_f(r.get('ulp_mean'), '.2g')}",
                        "–" if r.get("worst_token") is None else str(r["worst_token"] + res["alignment"]["target_start"]),
                        _f(r["threshold"], ".0e"), Text(status, style=style))
        console.print(tab)
        if mixed:
            lo = next(r["rounded_to"] for r in res["rows"] if "rounded_to" in r)
            console.print(Text(f"mixed precision: rel diff after rounding the finer side to {lo}; "
                               f"'as stored' compares the unrounded values", style="dim"))
        if res["alignment"].get("note", "").endswith("not checked"):
            console.print(Text(f"note: {res['alignment']['note']}", style="yellow"))
        console.print(Text(res["verdict"], style="bold green" if res["ok"] else "bold red"), soft_wrap=True)
        if res.get("cause"):
            c = res["cause"]
            console.print(Text(f"cause ({c['kind']}, {c['where']}): {c['detail']}", style="red"), soft_wrap=True)


def diff_command(
    baseline: Annotated[Path, typer.Argument(help="capture folder, SpecForge sample (.ckpt/.pt) or packed tensor file")],
    target: Annotated[Path, typer.Argument(help="the run to check against the baseline (same kinds of input)")],
    rank: Annotated[int, typer.Option("--rank", help="which rank of a capture folder")] = 0,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="every rank of the capture folder(s)")] = False,
    slots: Annotated[Optional[int], typer.Option("--slots", help="K: split a bare packed tensor into K slots")] = None,
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="H: split packed tensors into slots of width H")] = None,
    offset: Annotated[Optional[int], typer.Option("--offset", help="target token i = baseline token i+N")] = None,
    threshold: Annotated[Optional[str], typer.Option(
        "--threshold", help="rel diff a slot may have: 1e-3, or per target slot 0=1e-3,2=5e-2 "
                            "(default 1e-5 for float32 pairs, 2e-3 when a side is bf16/fp16)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Compare two runs of the same tokens slot by slot: training dump vs serving capture, tp=1 vs tp=N."""
    try:
        rep = run_diff(baseline, target, rank=rank, all_ranks=all_ranks, slots=slots, hidden=hidden,
                       offset=offset, threshold=threshold)
    except TPProbeError as e:
        if debug:
            raise
        # one line, never wrapped, whatever the terminal width
        sys.stderr.write(f"tpprobe: error: {' '.join(str(e).split())}\n")
        raise typer.Exit(e.exit_code)
    if json_out:
        sys.stdout.write(json.dumps(_clean(rep), indent=1, default=_jsonable, allow_nan=False) + "\n")
    else:
        from ..report.terminal import console
        render(rep, console())
    raise typer.Exit(rep["exit_code"])


def _clean(x):
    """JSON has no inf/NaN: non-finite numbers become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _jsonable(x):
    if isinstance(x, float):
        return None
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    return str(x)
