"""What the slot check was against: the draft's training, its config, or only the engine's own capture list.

A live plugin writes `draft_basis` into a step's settings (tpprobe/engines/draft_training.py):
`trained` (the user said what the draft was trained on: the slots are checked against that), `config`
(the draft's config under the engine's rule only) or `engine` (the engine's own capture list only). Only
`trained` can make a step HEALTHY for the draft; the other two add a `draft-unverified` warning saying what
the slots were checked against. When the draft was trained on other tensors than its config selects and
the engine captured exactly what the config says (catalogue F32), the slot finding says so, with the
trained and captured hidden_states of each slot and the ids that would fix the config.
"""
from __future__ import annotations

from .findings import WARNING, Finding


def _hs(p):
    if p is None:
        return None
    if p == "embed.out":
        return 0
    parts = str(p).split(".")
    return int(parts[1]) + 1 if len(parts) == 3 and parts[0] == "layer" and parts[2] == "out" else None


def draft_findings(settings: dict, slot_findings: list, rows: list, live: list) -> list:
    """Adds to `slot_findings` (in place) what F32 says about them; returns the basis warning, if any."""
    basis = settings.get("draft_basis")
    if basis is None or not rows:
        return []
    captured = [_hs(r.get("matched")) for r in rows]
    if slot_findings and settings.get("draft_ids_from") == "top level":
        # F19: the ids size the draft but the target never reads them: it captured its default list
        for f in slot_findings:
            f.kind = "id-contract"
            f.detail = (f"F19: the draft's eagle_aux_hidden_state_layer_ids {settings.get('draft_config_ids')} are at "
                        f"its config's top level, which sizes the draft's fc but which SGLang's target side never "
                        f"reads (it reads eagle_config.eagle_aux_hidden_state_layer_ids only): the target captured "
                        f"its default layers_to_capture {settings.get('sglang layers_to_capture')} = hidden_states "
                        f"{captured}; fix: move the ids into eagle_config — {f.detail}")
            f.evidence = {**f.evidence, "class": "F19", "captured_hs": captured}
    if basis == "trained":
        rule = settings.get("draft_rule_hs")
        trained = settings.get("draft_trained_hs")
        if slot_findings and rule is not None and captured == list(rule) and trained != rule:
            ids = settings.get("draft_config_ids")
            fix = settings.get("draft_fix")
            per = "; ".join(f"slot {i}: captured hidden_states[{c}], trained on hidden_states[{t}]"
                            for i, (c, t) in enumerate(zip(captured, trained or [])) if c != t)
            for f in slot_findings:
                # the engine applied its rule right: the shift is between the config and the training
                for guess in (" (the EAGLE-3 +1 was applied twice)", " (the EAGLE-3 +1 was not applied)"):
                    f.detail = f.detail.replace(guess, "")
                f.detail = (f"{f.detail} — F32: the engine captures exactly what the draft's config says (ids {ids} "
                            f"-> hidden_states {rule}) and the config is not what the draft was trained on "
                            f"(hidden_states {trained}, {settings.get('draft_training_from')}): {per}"
                            + (f"; {fix}" if fix else ""))
                f.evidence = {**f.evidence, "class": "F32", "captured_hs": captured, "trained_hs": trained,
                              "config_ids": ids,
                              "explain": "the engine captures what the draft's config says, and the config's ids are "
                                         "not the tensors the draft was trained on (catalogue F32): change the ids "
                                         "in the draft's config (the fix named) or retrain the draft on what the "
                                         "engine captures"}
        return []
    refused = settings.get("draft_training_refused")
    if basis == "config" and refused:
        text = (f"the aux slots were checked against the draft's config only (ids "
                f"{settings.get('draft_config_ids')} under the engine's rule: hidden_states "
                f"{settings.get('draft_rule_hs')}): what the draft was trained on was refused at capture, not used: "
                f"{refused}")
    elif basis == "config" and settings.get("draft_training_unmatched"):
        text = (f"the aux slots were checked against the draft's config only (ids "
                f"{settings.get('draft_config_ids')} under the engine's rule: hidden_states "
                f"{settings.get('draft_rule_hs')}): what the draft was trained on could not be read from "
                f"{settings['draft_training_unmatched']}; agreeing slots are no evidence the draft gets its "
                f"training's tensors")
    elif basis == "config":
        text = (f"the aux slots were checked against the draft's config only (ids "
                f"{settings.get('draft_config_ids')} under the engine's rule: hidden_states "
                f"{settings.get('draft_rule_hs')}); what the draft was trained on is unknown, so agreeing slots are "
                f"no evidence the draft gets its training's tensors: set "
                f"TPPROBE_DRAFT_TRAINED=ids:A,B,C (the HF hidden_states it was trained on), "
                f"convention:output|before|vllm or specforge:PATH (a SpecForge training sample) and capture again")
    else:
        text = (f"the aux slots were checked against the engine's own capture list only "
                f"({settings.get('sglang layers_to_capture') or settings.get('engine_capture') or '?'}): the engine "
                f"agreeing with itself, no evidence about the draft; the draft's own input is checked in the "
                f"step-N-draft_input folders, against its training when TPPROBE_DRAFT_TRAINED is set"
                + (f"; what the draft was trained on was refused at capture, not used: {refused}" if refused else ""))
    return [Finding("draft-unverified", "aux slots", list(live), severity=WARNING, detail=text,
                    evidence={"all_ranks": True, "basis": basis})]
