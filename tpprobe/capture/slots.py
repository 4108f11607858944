"""Which candidate each slot of the packed aux tensor equals, measured on the rank where the tensors are.

The packed aux tensor (what an EAGLE-3 draft receives) is hidden-wide slots side by side; each slot
should be one capture point's tensor. A fingerprint capture keeps few tensors, so the rank matches
the slots before its tensors are gone and writes the answer into its record (`slot_match`);
checks/slots.py judges it (or matches from the tensors itself, when every tensor was kept).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..core.noise import bitwise_equal, judge_dtype, within_noise
from ..fingerprint.levels import fp_dtype, fp_level
from ..fingerprint.reference import Fingerprint, fingerprint
from .points import EMBED_LOCAL, EMBED_OUT, in_norm, layer_streams

SLOT_CANDIDATES = (EMBED_OUT, in_norm(0), EMBED_LOCAL)


def slot_candidates(names) -> list[str]:
    """The points a slot may be, in preference order: the embedding's, the first input norm, then the layers'."""
    return [n for n in SLOT_CANDIDATES if n in names] + layer_streams(names)


def match_slots(packed: torch.Tensor, hidden: int, candidates: dict, dtype: torch.dtype) -> list[Optional[str]]:
    """For each hidden-wide slot of the packed aux tensor, the first candidate it equals (bitwise or
    within noise). candidates: name -> tensor or Fingerprint, in preference order."""
    out = []
    for s in packed.split(hidden, dim=-1):
        sfp = None
        # a capture is usually a bitwise copy of its candidate: try that cheap test on all first
        m = next((n for n, c in candidates.items() if not isinstance(c, Fingerprint) and bitwise_equal(s, c)), None)
        for name, c in ({} if m else candidates).items():
            if isinstance(c, Fingerprint):
                sfp = sfp or fingerprint(s, seed=c.seed, k=c.k)
                if fp_level(sfp, c, judge_dtype(s.dtype, fp_dtype(c), dtype)) in ("bitwise", "noise"):
                    m = name
                    break
            elif c.shape == s.shape and within_noise(s, c, judge_dtype(s.dtype, c.dtype, dtype)) is not None:
                m = name
                break
        out.append(m)
    return out


def tap_slot_match(tap, aux: torch.Tensor, hidden: int, dtype: torch.dtype) -> Optional[list[Optional[str]]]:
    """`match_slots` of the whole packed aux tensor against the tap's candidates: its kept tensors, else
    its fingerprints (fingerprints only when the tap kept sampled rows: a sample cannot stand for a
    whole tensor); None when the width is not whole slots of `hidden`."""
    if not hidden or aux.shape[-1] % hidden:
        return None
    names = [n for n in slot_candidates(tap.order) if n in tap.captures or n in tap.summaries]
    if tap.sample_rows is None:
        cands = {n: tap.captures[n] if n in tap.captures else tap.summaries[n] for n in names}
    else:
        cands = {n: tap.summaries[n] for n in names if n in tap.summaries}
    return match_slots(aux, hidden, cands, dtype)
