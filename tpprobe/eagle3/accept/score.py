"""Acceptance scored, teacher-forced: the draft's top-1 against the token sequence per source, and
`run_accept`, the command's data (baseline, target and, with --fix, the target's slots re-ordered)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from .draft import Draft, load_draft
from .engines import engine_for, resolve_device
from ...core.errors import UsageError

SCHEMA = "tpprobe.accept/1"
KS = (1, 2, 3, 4, 5)


# ---- scoring -----------------------------------------------------------------------------------
@contextmanager
def ieee_fp32(device: torch.device):
    """float32 matmuls without TF32 on cuda (restored after), so GPU and CPU agree to rounding."""
    if device.type != "cuda":
        yield
        return
    mods = (torch.backends.cuda.matmul, torch.backends.cudnn)
    # torch >= 2.9 says fp32_precision ("ieee" = no TF32); mixing it with the legacy allow_tf32 flags
    # is an error there, so each torch gets its own API
    attr, off = ("fp32_precision", "ieee") if hasattr(mods[0], "fp32_precision") else ("allow_tf32", False)
    old = [getattr(m, attr) for m in mods]
    for m in mods:
        setattr(m, attr, off)
    try:
        yield
    finally:
        for m, v in zip(mods, old):
            setattr(m, attr, v)


def agreement(engine, d: Draft, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """agree[t] for t in 0..T-3: the draft's top-1 at t (features t, token t+1) is token t+2.
    The forward and its argmax run on the engine's device; only the T-1 top-1 ids come back."""
    T = ids.numel()
    if T < 3:
        raise UsageError(f"{T} tokens: acceptance needs at least 3 (features t, token t+1, label t+2)")
    dev = getattr(engine, "device", torch.device("cpu"))
    with torch.no_grad(), ieee_fp32(dev):
        lg = engine.logits(feats[: T - 1].to(dev), ids[1:T].to(dev))
        top = lg.argmax(-1).cpu()
    top = d.to_target(top)
    return top[: T - 2] == ids[2:T]


def chain_starts(n: int, ks=KS) -> int:
    """How many start positions every chain length of `ks` is averaged over: those where the longest fits."""
    return max(0, n - max(ks) + 1)


def accept_lengths(agree: torch.Tensor, ks=KS) -> dict:
    """k -> expected accepted drafts of a chain of k: the leading accepted run from each start t, capped at k,
    averaged over the same starts for every k (those where the longest chain of `ks` fits), so a longer chain
    never reads lower; None when no start fits."""
    a = agree.to(torch.int64).tolist()
    starts = range(chain_starts(len(a), ks))
    runs = []
    for t in starts:
        r = 0
        while r < max(ks) and a[t + r]:
            r += 1
        runs.append(r)
    return {k: (sum(min(r, k) for r in runs) / len(runs)) if runs else None for k in ks}


@dataclass
class Scored:
    label: str
    source: str
    usable: bool
    why: str = ""
    top1: Optional[float] = None
    per_position: list = field(default_factory=list)
    accepted: dict = field(default_factory=dict)     # k -> expected accepted draft tokens

    def accept_length(self, k: int = 5) -> float:
        # no draft accepted: the target's own token
        return 1.0 if not self.usable else 1.0 + (self.accepted.get(k) or 0.0)

    def as_dict(self) -> dict:
        return {"label": self.label, "source": self.source, "usable": self.usable, "why": self.why,
                "top1_agreement": self.top1, "per_position": self.per_position,
                "accepted_drafts": {str(k): v for k, v in self.accepted.items()},
                "accept_length": {str(k): (None if not self.usable else 1.0 + (v or 0.0))
                                  for k, v in self.accepted.items()} if self.usable else
                                 {str(k): 1.0 for k in KS}}


def score(engine, d: Draft, label: str, source: str, packed: torch.Tensor, ids: torch.Tensor) -> Scored:
    want = d.k * d.target_hidden
    if packed.shape[-1] != want:
        w = int(packed.shape[-1])
        hint = ""
        if w < want and want % w == 0:
            hint = f" ({want // w}× too narrow: TP-sliced slots, {w // d.k} wide each?)"
        return Scored(label, source, False,
                      why=f"features are {w} wide, the draft's fc takes {d.k} × {d.target_hidden} = {want}{hint}: "
                          f"the draft cannot run on them (SGLang's fc matmul would fail); no draft token is accepted",
                      accepted={k: 0.0 for k in KS})
    if not torch.isfinite(packed).all():
        packed = torch.nan_to_num(packed)
    agree = agreement(engine, d, packed, ids)
    return Scored(label, source, True, top1=float(agree.float().mean()),
                  per_position=[int(x) for x in agree.tolist()], accepted=accept_lengths(agree))


# ---- the command -------------------------------------------------------------------------------
def _sides(baseline, target, tokens_from, rank):
    from ..diff.load import load_side
    b = load_side("baseline", baseline, rank)
    t = load_side("target", target, rank)
    tok = load_side("tokens", tokens_from, rank) if tokens_from else None
    if tok is not None and tok.input_ids is None:
        raise UsageError(f"--tokens-from {tokens_from}: it holds no input_ids; pass a capture folder or SpecForge "
                         f"sample that records the token sequence")
    ids = None
    for s in ([tok] if tok else []) + [t, b]:
        if s is not None and s.input_ids is not None:
            ids = s.input_ids.reshape(-1).to(torch.int64)
            src = s.path
            break
    if ids is None:
        raise UsageError("none of the sources has input_ids: pass --tokens-from with a capture or SpecForge "
                         "sample of the same tokens")
    for s in (b, t):
        n = int(s.packed.shape[0])
        if s.input_ids is not None:
            if not torch.equal(s.input_ids.reshape(-1).to(torch.int64), ids):
                raise UsageError(f"{s.role} {s.path} was captured on other tokens than {src}: both sources must "
                                 f"hold the same sequence (the draft is scored on one token sequence)")
        if n != ids.numel():
            raise UsageError(f"{s.role} {s.path} has {n} token rows, the token sequence from {src} has "
                             f"{ids.numel()}: pass --tokens-from with the sequence these features were captured on")
    return b, t, ids, src


def _fixed(b, t, d: Draft):
    """B's slots re-ordered by the diff's slot matcher; (packed, how, explained)."""
    from ..diff.compare import default_threshold
    from ..diff.load import split_slots
    from ..diff.match import diff_sides
    from ..diff.tokens import align
    split_slots(b, d.target_hidden, None, t)
    split_slots(t, d.target_hidden, None, b)
    al = align(b, t, None)
    thr = default_threshold(b, t)
    res = diff_sides(b, t, al, [thr] * len(t.slots), thr)
    match = res["match"]
    order, explained = [], True
    for i in range(len(b.slots)):
        js = [j for j, m in enumerate(match) if m == i]
        if js:
            order.append(js[0])
        else:
            explained = False
            order.append(i if i < len(t.slots) else None)
    if any(o is None for o in order):
        return None, "the target has fewer slots than the baseline", False
    from ...capture.points import point_label
    tid = (res.get("identity") or {}).get("target") or []

    def holds(i: int, j: int) -> str:
        # what slot i then holds: target slot j's stream, named when it is recognised; matched, the baseline's slot i
        p = tid[j].get("point") if j < len(tid) and tid[j] else None
        same = match[j] == i
        if p:
            return f"slot {i} then holds {point_label(p)}" + (f", as the baseline's slot {i} does" if same else "")
        return f"slot {i} then holds what the baseline's slot {i} holds" if same else \
            f"slot {i} then holds target slot {j}'s stream, unlike the baseline's slot {i}"
    how = ", ".join(f"slot {i} ← target slot {j} ({holds(i, j)})" for i, j in enumerate(order) if i != j) \
        or "no change"
    packed = torch.cat([t.slots[j] for j in order], dim=-1)
    return packed, how, explained


def run_accept(draft, baseline, target, tokens_from=None, fix=False, engine="auto", embed=None,
               rank=0, tolerance=0.05, device="auto") -> dict:
    if not tolerance >= 0:         # NaN too
        raise UsageError(f"--tolerance {tolerance:g}: give an accept-length difference >= 0 (default 0.05)")
    dev = resolve_device(device, engine)
    d = load_draft(draft, embed)
    b, t, ids, src = _sides(baseline, target, tokens_from, rank)
    K = max(KS)
    if ids.numel() < K + 2:       # no start position fits a chain of K: every accept length would read 1.00
        raise UsageError(f"the token sequence from {src} has {ids.numel()} tokens: a chain of {K} drafted tokens "
                         f"needs at least {K + 2} (features t, tokens t+1 … t+{K + 1}); capture a longer sequence")
    if ids.numel() and (int(ids.max()) >= d.vocab or int(ids.min()) < 0):
        raise UsageError(f"the token sequence from {src} has ids up to {int(ids.max())}, outside the draft's "
                         f"vocabulary [0, {d.vocab}): is this the draft of another model?")
    eng, eng_name = engine_for(d, engine, dev)
    rows = [score(eng, d, "baseline", str(b.path), b.packed, ids),
            score(eng, d, "target", str(t.path), t.packed, ids)]
    fix_info = None
    if fix:
        if t.packed.shape[-1] % d.target_hidden or b.packed.shape[-1] % d.target_hidden:
            fix_info = {"how": "not applied: slot widths do not match the draft's target hidden", "explained": False}
        else:
            packed, how, explained = _fixed(b, t, d)
            fix_info = {"how": how, "explained": explained}
            if packed is not None:
                rows.append(score(eng, d, "target, slots re-ordered", str(t.path), packed, ids))
    base, tgt = rows[0].accept_length(K), rows[1].accept_length(K)
    cost = base - tgt
    line = (f"the target capture costs {cost:.2f} accept length (chain of {K}: {base:.2f} -> {tgt:.2f})"
            if cost > tolerance else
            f"the target capture costs nothing measurable (chain of {K}: {base:.2f} vs {tgt:.2f}, "
            f"tolerance {tolerance})")
    if len(rows) == 3:
        rem = base - rows[2].accept_length(K)
        line += (f"; with slots re-ordered as the matcher proposes ({fix_info['how']}), {rem:.2f} remains"
                 if fix_info["explained"] else
                 f"; re-ordering slots ({fix_info['how']}) does not explain it: {rem:.2f} remains")
    elif fix_info:
        line += f"; --fix {fix_info['how']}"
    if not rows[1].usable:
        line += f" — {rows[1].why}"
    ok = cost <= tolerance
    return {"schema": SCHEMA, "ok": ok, "exit_code": 0 if ok else 1, "line": line, "engine": eng_name,
            "device": str(dev), **({"device_name": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}),
            "draft": d.describe(), "tokens": int(ids.numel()), "tokens_from": str(src),
            "estimate": "teacher-forced: step j of a chain started at t is accepted iff the draft, fed the "
                        "source's features at t+j-1 and token t+j, proposes token t+j+1; accept length = 1 + "
                        f"the leading accepted run (SGLang counts the target's own token), every k averaged over "
                        f"the same starts t, those where a chain of {K} fits",
            "chain_lengths": list(KS), "chain_starts": chain_starts(int(ids.numel()) - 2), "fix": fix_info,
            "rows": [r.as_dict() for r in rows],
            "cost": cost, "tolerance": tolerance}
