"""Serving-path faults injected into SGLang's own model (`tpprobe probe --backend sglang --inject`).

Each one changes what SGLang's EAGLE-3 aux capture stores the way the real bug did, at the stage
boundary where SGLang 0.5.23 captures (`StageBoundary._prepare_attention`), and never touches
what tpprobe observes of the residual stream: the probe must find it on its own.

  fused-allreduce-capture (F16)  the aux capture reads the stream BEFORE the owed (deferred, on GPUs
      fused into add+RMSNorm) all-reduce of the previous layer completes: each rank stores its own
      partial sum plus the residual, the pre-fix capture point of sglang PR #28343.
  dp-attention-gather (F17)      under DP attention the aux rows (each attention-TP rank's share of
      its group's tokens) are all-gathered over the TP group instead of the attention-TP group, so
      the draft gets every attention-DP group's rows (sglang PR #20492, issue #16274).
  capture-no-residual (F18)      the aux capture stores the previous layer's output alone (the
      reduced delta, `hidden_states`) instead of the stream (hidden + residual): SpecForge#431,
      sglang#39286.

How: the capturing layers' `attn_boundary.prepare` is wrapped to note, before SGLang completes
the owed sum, the rank-local partial and the residual; SGLang's aux collectors
(`AuxHiddenStateList.capture`, `AuxHiddenStatePacker.capture`) then store the faulty value in
place of the value SGLang hands them, only during that boundary.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

SGLANG_FAULTS = ("fused-allreduce-capture", "capture-no-residual", "dp-attention-gather")

_pending = threading.local()
_ALWAYS: dict = {"fn": None}       # a fault on every aux capture (dp-attention-gather)


def _layers(model):
    inner = getattr(model, "model", model)
    return list(getattr(inner, "layers", None) or [])


def _patch_collectors() -> None:
    from sglang.srt.layers import aux_hidden_states as aux

    for cls in (aux.AuxHiddenStateList, aux.AuxHiddenStatePacker):
        if getattr(cls.capture, "_tpprobe_fault", False):
            continue
        orig = cls.capture

        def capture(self, hidden, *, owned: bool = False, _orig=orig):
            fault = getattr(_pending, "fn", None) or _ALWAYS["fn"]
            if fault is not None:
                hidden, owned = fault(hidden), True
            return _orig(self, hidden, owned=owned)

        capture._tpprobe_fault = True
        cls.capture = capture


def inject(name: str, model) -> None:
    """Apply serving fault `name` to SGLang model `model` (every capturing boundary)."""
    from sglang.srt.layers.layer_boundary.residual.stream import OwedOutput

    _patch_collectors()
    if name == "dp-attention-gather":
        _ALWAYS["fn"] = gather_over_tp_group
        return
    for i, layer in enumerate(_layers(model)):
        if i == 0:
            continue                     # capture point 0 is the embedding: no residual yet
        b = getattr(layer, "attn_boundary", None)
        if b is None:
            continue
        orig = b.prepare

        def prepare(hidden_states, forward_batch, *a, _orig=orig, **kw):
            stream = getattr(forward_batch, "residual_stream", None)
            residual = getattr(stream, "residual", None)
            fn = None
            if isinstance(residual, torch.Tensor):
                old = residual.detach().clone()
                if name == "fused-allreduce-capture":
                    partial = _partial(hidden_states, OwedOutput)
                    if partial is not None:
                        fn = (lambda v, p=partial, r=old: (p + r).to(v.dtype))
                elif name == "capture-no-residual":
                    fn = (lambda v, r=old: (v - r).to(v.dtype))
            _pending.fn = fn
            try:
                return _orig(hidden_states, forward_batch, *a, **kw)
            finally:
                _pending.fn = None

        b.prepare = prepare


def gather_over_tp_group(value: torch.Tensor) -> torch.Tensor:
    """F17 (sglang PR #20492): the aux rows are this rank's attention-TP share of the DP-local
    tokens, and they are all-gathered over the TP group where the attention-TP group was meant:
    the result holds every attention-DP group's rows, not this group's."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group

    attn, tp = get_attn_tp_group(), get_tp_group()
    rows = value.shape[0] // attn.world_size
    mine = value[attn.rank_in_group * rows:(attn.rank_in_group + 1) * rows].contiguous()
    return tp.all_gather(mine, dim=0)


def _partial(hidden, owed_cls) -> Optional[torch.Tensor]:
    """This rank's partial sum still owed by the previous layer (a copy), or None when complete."""
    if not isinstance(hidden, owed_cls):
        return None
    c = hidden.contribution
    if c.owed is None or not isinstance(c.value, torch.Tensor):
        return None
    return c.value.detach().clone()
