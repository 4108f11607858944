"""What an EAGLE-3 draft was trained on, as the user says it, and the slots each aux slot must then hold.

A live capture can prove that the engine captures what the draft's config says (the engine's rule applied
to `eagle_aux_hidden_state_layer_ids`); only what the draft was trained on can prove the config right
(catalogue F32: every check healthy, the config not what the draft was trained on). The user says it in the
engine plugin's environment, with the grammar of the vLLM side (tpprobe/engines/vllm/acceptance.py):

  TPPROBE_DRAFT_TRAINED=ids:A,B,C          the HF `hidden_states` indices the draft was trained on, in slot order
                                           (0 = the embedding output, k = layer k-1's output); `A,B,C` alone too
  TPPROBE_DRAFT_TRAINED=convention:NAME    the draft config's own ids read in a training convention, slots in
                                           the ids' written order: `output` (SpecForge's: id k = layer k's
                                           output = hidden_states[k+1]), `before` (id k = the input of layer k
                                           = hidden_states[k]), `vllm` (vLLM's rule: id k = hidden_states[k],
                                           sorted, each once)

Not given: the expected slots are the draft config's ids under the engine's rule, and the report says the
draft was checked against its config only (kind `draft-unverified`, a warning): never HEALTHY for the draft
from the engine agreeing with itself.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..capture.points import EMBED_OUT, layer_out
from ..core.errors import UsageError

ENV = "TPPROBE_DRAFT_TRAINED"
CONVENTIONS = ("output", "before", "vllm")


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


def parse(spec: Optional[str]) -> Optional[dict]:
    """The training a TPPROBE_DRAFT_TRAINED value says: {"hidden_states": [...]} or {"convention": ...}, with
    "from"; None when empty. Bad text: UsageError (one line: what is wrong, what to write)."""
    spec = (spec or "").strip()
    if not spec:
        return None
    kind, _, val = spec.partition(":")
    if not val:
        kind, val = "ids", spec
    kind = kind.strip().lower()
    if kind == "ids":
        try:
            vals = [int(x) for x in val.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"{ENV}={spec!r}: ids:A,B,C takes integers (the HF hidden_states indices the draft was "
                             f"trained on, in slot order)") from None
        if not vals or min(vals) < 0:
            raise UsageError(f"{ENV}={spec!r}: hidden_states indices are >= 0 (0 = the embedding output)")
        return {"hidden_states": vals, "from": f"{ENV}={spec}"}
    if kind == "convention":
        conv = val.strip().lower()
        if conv not in CONVENTIONS:
            raise UsageError(f"{ENV}={spec!r}: conventions are {', '.join(CONVENTIONS)}")
        return {"convention": conv, "from": f"{ENV}={spec}"}
    raise UsageError(f"{ENV}={spec!r}: give ids:A,B,C (HF hidden_states indices in slot order) or "
                     f"convention:{'|'.join(CONVENTIONS)}")


def from_env(env=None) -> Optional[dict]:
    """`parse` of TPPROBE_DRAFT_TRAINED in `env` (default: this process's environment)."""
    if env is None:
        from ..config.knobs import knob
        return parse(knob(ENV))
    return parse(env.get(ENV))


def trained_hidden_states(training: Optional[dict], config_ids: Optional[list[int]]) -> Optional[list[int]]:
    """The HF hidden_states index of each slot the draft was trained on (slot order), or None (unknown)."""
    if not training:
        return None
    if "hidden_states" in training:
        return list(training["hidden_states"])
    if config_ids is None:
        return None
    if training["convention"] == "vllm":
        return sorted({int(i) for i in config_ids})
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
