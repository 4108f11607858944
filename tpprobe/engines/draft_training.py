"""What an EAGLE-3 draft was trained on, as the user says it, and the slots each aux slot must then hold.

A live capture can prove that the engine captures what the draft's config says (the engine's rule applied
to `eagle_aux_hidden_state_layer_ids`); only what the draft was trained on can prove the config right
(catalogue F32: every check healthy, the config not what the draft was trained on). The user says it with
one of (environment of the engine's plugin; the same names on every engine):

  TPPROBE_DRAFT_HIDDEN_STATES  the HF `hidden_states` indices the draft was trained on, in slot order
                               (0 = the embedding output, k = layer k-1's output), e.g. "0,2,3"
  TPPROBE_DRAFT_CONVENTION     the convention of the draft config's own ids at training time: `output`
                               (SpecForge's: id k = layer k's output = hidden_states[k+1]) or `before`
                               (id k = the input of layer k = hidden_states[k]); slots in the ids' written
                               order (the words of `tpprobe layers --draft-convention`)

Neither given: the expected slots are the draft config's ids under the engine's rule, and the report says
the draft was checked against its config only (kind `draft-unverified`, a warning): never HEALTHY for the
draft from the engine agreeing with itself.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from ..capture.points import EMBED_OUT, layer_out
from ..core.errors import UsageError

ENV_HIDDEN_STATES = "TPPROBE_DRAFT_HIDDEN_STATES"
ENV_CONVENTION = "TPPROBE_DRAFT_CONVENTION"
CONVENTIONS = ("output", "before")


def hs_point(h: Optional[int]) -> Optional[str]:
    """tpprobe's capture point equal to HF hidden_states[h] (0: the embedding output)."""
    if h is None:
        return None
    return EMBED_OUT if h == 0 else layer_out(h - 1)


def hs_of_point(p: Optional[str]) -> Optional[int]:
    if p is None:
        return None
    if p == EMBED_OUT:
        return 0
    if p.startswith("layer.") and p.endswith(".out"):
        return int(p.split(".")[1]) + 1
    return None


def from_env(env=None) -> Optional[dict]:
    """The training the user declared: {"hidden_states": [...]} or {"convention": ...}; None when neither.
    Bad text: UsageError (one line: what is wrong, what to write)."""
    env = os.environ if env is None else env
    hs, conv = (env.get(ENV_HIDDEN_STATES) or "").strip(), (env.get(ENV_CONVENTION) or "").strip().lower()
    if hs:
        try:
            vals = [int(x) for x in hs.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"{ENV_HIDDEN_STATES}={hs!r}: write the HF hidden_states indices the draft was trained "
                             f"on, comma-separated, e.g. 0,2,3") from None
        if not vals or min(vals) < 0:
            raise UsageError(f"{ENV_HIDDEN_STATES}={hs!r}: indices are >= 0 (0 = the embedding output)")
        return {"hidden_states": vals, "from": f"{ENV_HIDDEN_STATES}={hs}"}
    if conv:
        if conv not in CONVENTIONS:
            raise UsageError(f"{ENV_CONVENTION}={conv!r}: use output (SpecForge's: id k = layer k's output) "
                             f"or before (id k = the input of layer k)")
        return {"convention": conv, "from": f"{ENV_CONVENTION}={conv}"}
    return None


def trained_hidden_states(training: Optional[dict], config_ids: Optional[list[int]]) -> Optional[list[int]]:
    """The HF hidden_states index of each slot the draft was trained on (slot order), or None (unknown)."""
    if not training:
        return None
    if "hidden_states" in training:
        return list(training["hidden_states"])
    if config_ids is None:
        return None
    shift = 1 if training["convention"] == "output" else 0
    return [int(i) + shift for i in config_ids]


def propose_ids(trained_hs: list[int], slots_for: Callable[[list[int]], Optional[list[int]]],
                num_layers: int) -> tuple[Optional[list[int]], str]:
    """Ids for the draft's config that make the engine capture `trained_hs` in that slot order, found by
    asking the engine's rule (`slots_for(ids)` -> the hidden_states index of each slot, None: the ids
    crash); ([...], how) or (None, why no id list can)."""
    tried = []
    for shift in (1, 0):
        ids = [h - shift for h in trained_hs]
        got = slots_for(ids)
        tried.append((ids, got))
        if got == list(trained_hs):
            return ids, "the engine's rule applied to these ids captures exactly the trained slots"
    if list(trained_hs) != sorted(trained_hs):
        return None, (f"the draft was trained with its slots in the order of hidden_states {trained_hs}, but the "
                      f"engine fills the slots in layer order: no id list can give it that order (the draft needs "
                      f"retraining on layer order, or the engine a capture that packs in the ids' order)")
    if num_layers in trained_hs:
        return None, (f"hidden_states[{num_layers}] (the last layer's output) is not reachable by this engine's "
                      f"capture for this architecture")
    if 0 in trained_hs:
        return None, ("the draft was trained with the embedding output (hidden_states[0]) and no id reaches it on this "
                      "architecture's rule: the engine's capture would need to take the embedding (a code change in "
                      "the model's set_eagle3_layers_to_capture / its loop)")
    return None, f"no id list tried ({', '.join(str(i) for i, _ in tried)}) captures hidden_states {trained_hs}"


def basis(settings: dict) -> Optional[str]:
    """What a step's slots were checked against: `trained`, `config` (the draft's config only), `engine`
    (the engine's own capture list only), None (no draft information: not a live capture)."""
    return settings.get("draft_basis")
