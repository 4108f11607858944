"""Why an aux slot equals no capture point: the serving-path causes named by the all-reduce audit.

An EAGLE-3 slot should hold the residual stream S = out_j + R, where out_j is the all-reduce
that completed the previous layer's sum and R the residual it is added to. Two known bugs store
something else, and the audit's own tensors (each all-reduce's input and output, per rank) name
them exactly:

  partial-capture      (F16) slot = in_j(rank) + R = S - out_j + in_j(rank): each rank's partial
                       sum, read before the owed all-reduce j completed (the capture ahead of a
                       deferred, on GPUs fused, all-reduce + RMSNorm; sglang PR #28343)
  capture-no-residual  (F18) slot = out_j: the layer's reduced output (hidden_states) without the
                       residual (SpecForge#431, sglang#39286)

From every rank's tensors (--exchange full, or a capture folder), or, with fingerprints only, from the
linear sketches: each rank fingerprints the slots that equal no capture point (`slot_fps`, capture/record.py)
beside its points' and every all-reduce's input and output, and sketch(S - out_j + in_j) is
sketch(S) - sketch(out_j) + sketch(in_j), so both causes are judged with no tensor moved.
"""
from __future__ import annotations

from typing import Optional

from ..capture.points import AUX_PACKED, allreduce_in, allreduce_out
from ..capture.schema import Collective
from ..core.noise import compare
from ..fingerprint.levels import fp_level
from ..fingerprint.reference import Fingerprint, sum_matches
from .looks import scaled_fp


def _close(a, b, dtype) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        compare(a, b, dtype=dtype)["level"] in ("bitwise", "noise")


def _name(a: Collective) -> str:
    who = a.source or a.module or "?"
    grp = f", group {a.group}" if a.group else ""
    lay = f"layer {a.layer}" if a.layer is not None else a.where
    return f"all-reduce #{a.seq} ({who}, {lay}{grp}, {a.group_size} ranks)"


def explain_rows(records, r: int, hidden: int, expected: list, settings: dict) -> Optional[tuple]:
    """(kind, where, detail) when rank r's packed aux holds the rows of every attention-DP group
    (each n-row block equal to the stream it should hold): gathered over the TP group (F17)."""
    rec = records[r]
    packed = rec.tensors.get(AUX_PACKED)
    first = next((e for e in expected if e), None)
    S = rec.tensors.get(first) if first else None
    if packed is None or S is None or packed.shape[0] == S.shape[0] or packed.shape[0] % S.shape[0]:
        return None
    n, k = S.shape[0], packed.shape[0] // S.shape[0]
    dtype = packed.dtype
    for i, e in enumerate(expected):
        T = rec.tensors.get(e) if e else None
        if T is None or (i + 1) * hidden > packed.shape[-1]:
            return None
        col = packed[..., i * hidden:(i + 1) * hidden]
        if not all(_close(col[j * n:(j + 1) * n].float(), T.float(), dtype) for j in range(k)):
            return None
    world, dp = settings["world_size"], int(settings.get("attn_dp") or 1)
    attn = int(settings.get("attn_tp") or world // max(dp, 1))
    groups = [list(range(g * attn, (g + 1) * attn)) for g in range(world // attn)] if dp > 1 else []
    tp = next((a.group for a in rec.meta.collectives if a.group_ranks is None and a.group), "the TP group")
    return ("dp-gather-group", AUX_PACKED,
            f"the packed aux has {k} × {n} rows: every slot holds the rows of {k} attention-DP groups (block j "
            f"= group j's tokens), gathered over {tp} ({world} ranks) where the attention-TP group "
            f"({attn} ranks: {' and '.join(map(str, groups)) if groups else 'attention_tp'}) was meant; the draft "
            f"gets other groups' tokens")


def explain(ev, records, live: list[int], hidden: int, slot: int, expected: Optional[str],
            slot_id, dtype) -> Optional[tuple]:
    """(kind, where, detail) when slot `slot` is a partial capture or lacks the residual on every
    live rank, by the same all-reduce; else None."""
    if expected is None:
        return None
    found: dict[str, set] = {"partial-capture": set(), "capture-no-residual": set()}
    for n, r in enumerate(live):
        here = _tensor_causes(records[r], hidden, slot, expected, dtype)
        if here is None or not any(here.values()):
            # a fingerprint run keeps a few reduces' tensors (the embedding's), not every one: the sketches say
            here = _sketch_causes(records[r], slot, expected, dtype) or here
        if here is None:
            return None
        for k in found:
            found[k] = here[k] if n == 0 else found[k] & here[k]
    audit = {a.seq: a for a in records[live[0]].meta.collectives}
    from ..capture.points import point_label

    idtext = f" (id {slot_id})" if slot_id is not None else ""
    if found["partial-capture"]:
        a = audit[max(found["partial-capture"])]
        return ("partial-capture", f"aux slot {slot}",
                f"slot {slot}{idtext} holds each rank's partial sum of {_name(a)} plus the residual: the "
                f"capture read the stream before that owed all-reduce completed (ahead of a deferred / fused "
                f"all-reduce+RMSNorm), so the ranks disagree; expected {point_label(expected)}, the full "
                f"sum, the same on every rank")
    if found["capture-no-residual"]:
        a = audit[max(found["capture-no-residual"])]
        return ("capture-no-residual", f"aux slot {slot}",
                f"slot {slot}{idtext} holds the output of {_name(a)} alone: the layer's reduced output "
                f"(hidden_states) without the residual; expected {point_label(expected)} = hidden_states "
                f"+ residual")
    return None


def _tensor_causes(rec, hidden: int, slot: int, expected: str, dtype) -> Optional[dict]:
    """{cause: seqs of the reduces that explain slot `slot`} from rank `rec`'s tensors; None without them."""
    packed, S = rec.tensors.get(AUX_PACKED), rec.tensors.get(expected)
    if packed is None or S is None or packed.shape[-1] < (slot + 1) * hidden:
        return None
    s = packed[..., slot * hidden:(slot + 1) * hidden].float()
    here: dict[str, set] = {"partial-capture": set(), "capture-no-residual": set()}
    # sizes that differ are evidence: a slot of other rows than its stream (the rows of every attention-DP
    # group, F17) is no partial capture of it, and a reduce of other rows is neither cause
    rows_of_stream = tuple(S.shape) == tuple(s.shape)
    for a in rec.meta.reduces:          # a sum's output, never a gather's (a gathered stream is no layer's output)
        i, o = rec.tensors.get(allreduce_in(a.seq)), rec.tensors.get(allreduce_out(a.seq))
        if i is None or o is None or tuple(o.shape) != tuple(s.shape):
            continue
        if _close(s, o.float(), dtype):
            here["capture-no-residual"].add(a.seq)
        elif rows_of_stream and tuple(i.shape) == tuple(s.shape) \
                and _close(s, (S.float() - o.float() + i.float()), dtype) and not _close(i.float(), o.float(), dtype):
            here["partial-capture"].add(a.seq)
    return here


def _fp(d) -> Optional[Fingerprint]:
    return Fingerprint.from_json(d) if isinstance(d, dict) else None


def _sketch_close(a: Fingerprint, b: Fingerprint, dtype) -> bool:
    return a.shape == b.shape and a.k == b.k and a.seed == b.seed and fp_level(a, b, dtype) in ("bitwise", "noise")


def _sketch_causes(rec, slot: int, expected: str, dtype) -> Optional[dict]:
    """The same from rank `rec`'s fingerprints (linear sketches): slot = out_j when sketch(slot) ~ sketch(out_j);
    slot = S - out_j + in_j when sketch(slot) + sketch(out_j) ~ sketch(S) + sketch(in_j). None without them."""
    s = _fp((rec.meta.slot_fps or {}).get(str(slot)))
    S = _fp((rec.meta.fingerprints or {}).get(expected))
    if s is None or S is None or s.shape != S.shape or s.k != S.k or s.seed != S.seed or s.n_nan or s.n_inf:
        return None
    here: dict[str, set] = {"partial-capture": set(), "capture-no-residual": set()}
    for a in rec.meta.reduces:
        i, o = _fp(a.in_fp), _fp(a.out_fp)
        if i is None or o is None or o.shape != s.shape or i.shape != s.shape or o.k != s.k or o.seed != s.seed \
                or i.k != s.k or i.seed != s.seed or i.n_nan or i.n_inf or o.n_nan or o.n_inf:
            continue
        if _sketch_close(s, o, dtype):
            here["capture-no-residual"].add(a.seq)
        elif not _sketch_close(i, o, dtype) and sum_matches(s, [S, scaled_fp(o, -1.0), i], dtype)[0]:
            here["partial-capture"].add(a.seq)
    return here
