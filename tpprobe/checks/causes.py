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

Needs every rank's tensors (--exchange full, or a capture folder); with fingerprints only the
generic slot verdict applies.
"""
from __future__ import annotations

from typing import Optional

from ..capture.points import AUX_PACKED, allreduce_in, allreduce_out
from ..core.noise import compare


def _close(a, b, dtype) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        compare(a, b, dtype=dtype)["level"] in ("bitwise", "noise")


def _name(a: dict) -> str:
    who = a.get("source") or a.get("module") or "?"
    grp = f", group {a['group']}" if a.get("group") else ""
    lay = f"layer {a['layer']}" if a.get("layer") is not None else a.get("where", "?")
    return f"all-reduce #{a['seq']} ({who}, {lay}{grp}, {a.get('group_size', '?')} ranks)"


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
    tp = next((a.get("group") for a in rec.meta.get("allreduces", []) if a.get("group_ranks") is None
               and a.get("group")), "the TP group")
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
        rec = records[r]
        packed, S = rec.tensors.get(AUX_PACKED), rec.tensors.get(expected)
        if packed is None or S is None or packed.shape[-1] < (slot + 1) * hidden:
            return None
        s = packed[..., slot * hidden:(slot + 1) * hidden].float()
        here = {"partial-capture": set(), "capture-no-residual": set()}
        for a in rec.meta.get("allreduces", []):
            i, o = rec.tensors.get(allreduce_in(a["seq"])), rec.tensors.get(allreduce_out(a["seq"]))
            if i is None or o is None or tuple(o.shape) != tuple(s.shape):
                continue
            if _close(s, o.float(), dtype):
                here["capture-no-residual"].add(a["seq"])
            elif _close(s, (S.float() - o.float() + i.float()), dtype) and not _close(i.float(), o.float(), dtype):
                here["partial-capture"].add(a["seq"])
        for k in found:
            found[k] = here[k] if n == 0 else found[k] & here[k]
    audit = {a["seq"]: a for a in records[live[0]].meta.get("allreduces", [])}
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
