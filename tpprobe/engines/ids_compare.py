"""One EAGLE-3 draft against both engines: what each id captures on SGLang and on vLLM, from configs alone.

`compare(draft, target, ...)` reads the draft's ids the way each engine's target side reads them
(SGLang: `eagle_config.eagle_aux_hidden_state_layer_ids` only; vLLM: its model runner's reader,
tpprobe.engines.vllm.layer_ids.config_ids), applies each engine's capture rule for the target's
architecture (SGLang's +1 rules; vLLM's ids as written) and lines the slots up by the HF
`hidden_states` index each holds. One verdict when the engines differ (catalogue F26, vLLM PR #43671):
a draft trained on one engine's slots reads one layer early (or late) on the other.
"""
from __future__ import annotations

from typing import Optional

CONVENTIONS = {"output": "the output-of-layer ids (id k = layer k's output = HF hidden_states[k+1], SpecForge's)",
               "before": "the capture-before ids (id k = the input of layer k = HF hidden_states[k])"}


def sglang_config_ids(draft: dict) -> tuple[Optional[list[int]], str]:
    """The ids SGLang's target side reads from a draft config (spec_aux_hidden_state.py: only the nested ids)."""
    eagle = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else None
    ids = (eagle or {}).get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and eagle.get("use_aux_hidden_state", True) and ids is not None:
        return list(ids), "eagle_config.eagle_aux_hidden_state_layer_ids"
    return None, "no eagle_config.eagle_aux_hidden_state_layer_ids: the model's default [2, L//2, L-3]"


def draft_ids(draft: dict) -> Optional[list[int]]:
    eagle = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or draft.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def _slots(p, ids: Optional[list[int]]) -> list[Optional[int]]:
    """Slot by slot, the HF hidden_states index each holds. When the engine crashes on the draft's own ids,
    what each id would capture in the draft's order (None for an id that captures nothing), so a crash on one
    id never hides what the others read."""
    if not p.crash:
        return p.slot_hf_indices
    if ids is not None and p.ids is not None and list(p.ids) == list(ids) and len(p.rows) == len(ids):
        return [r.hf_index if r.captured else None for r in p.rows]
    return []


def compare(draft: dict, arch: str, num_layers: int, convention: str = "output", runner: str = "v2",
            text_arch: Optional[str] = None, id_rules: Optional[dict] = None) -> dict:
    """Slot by slot, the HF hidden_states index each engine captures for this draft (and what the draft
    expects under `convention`); `verdict` is one line when the engines differ, else None."""
    from tpprobe.engines.capture_rule import plan_for
    from tpprobe.engines.vllm.layer_ids import config_ids

    N = int(num_layers)
    s_ids, s_from = sglang_config_ids(draft)
    v_ids, v_from = config_ids(draft, runner)
    other = "v1" if runner == "v2" else "v2"
    o_ids, o_from = config_ids(draft, other)
    # each engine's rules know the wrappers it serves (SGLang's KimiK25ForConditionalGeneration delegates in its
    # table; vLLM's resolves to the text model it hands the ids to): the wrapper is looked up, never guessed
    rules = id_rules or {}      # a patched build's capture of some ids, per engine (engines.capture_rule)
    sp = plan_for("sglang", arch, s_ids, N, rules.get("sglang"))
    vp = plan_for("vllm", arch, v_ids, N, rules.get("vllm"))
    ids = draft_ids(draft)
    s_slots, v_slots = _slots(sp, ids), _slots(vp, ids)
    shift = 1 if convention == "output" else 0
    want = [i + shift for i in ids] if ids is not None else None
    rows = []
    for j in range(max(len(s_slots), len(v_slots), len(want or []))):
        s = s_slots[j] if j < len(s_slots) else None
        v = v_slots[j] if j < len(v_slots) else None
        w = want[j] if want is not None and j < len(want) else None
        rows.append({"slot": j, "draft_id": ids[j] if ids and j < len(ids) else None, "draft_expects": w,
                     "sglang": s, "vllm": v, "same": s == v and s is not None})
    notes = []
    runner_note = None        # for who serves vLLM: the terminal shows it with --engine vllm / --vllm-runner
    if o_ids != v_ids:
        runner_note = (f"vLLM's {other} model runner reads other ids: {o_ids if o_ids else 'none'} ({o_from}); "
                       f"the table uses the {runner} runner ({v_from})")
        notes.append(runner_note)
    if vp.sglang_class != arch:
        notes.append(f"vLLM: {arch} hands the ids to its text model {vp.sglang_class}"
                     f"{f' ({text_arch}, under text_config)' if text_arch and text_arch != vp.sglang_class else ''}: "
                     f"vLLM's rule for {vp.sglang_class}")
    for name, p in (("SGLang", sp), ("vLLM", vp)):
        if p.crash:
            notes.append(f"{name}: {p.crash}")
        elif p.problems:
            notes.append(f"{name}: {'; '.join(p.problems)}")
    differ = [r for r in rows if not r["same"]]
    crashed = [(name, p.crash) for name, p in (("SGLang", sp), ("vLLM", vp)) if p.crash]
    verdict = _verdict(rows, differ, convention, want, crashed) if differ else None
    # each engine that does not give the draft what it expects: the ids to write there (or why none do)
    from tpprobe.engines.capture_rule import ids_to_write
    fixes = {}
    for engine, p in (("sglang", sp), ("vllm", vp)):
        got = [r[engine] for r in rows]
        if want is not None and (p.crash or got != want):
            fx = ids_to_write(engine, arch, N, want, ids, rules.get(engine))
            if fx is not None:
                fixes[engine] = fx
    return {"target_arch": arch, "sglang_arch": sp.sglang_class, "vllm_arch": vp.sglang_class, "num_layers": N,
            "draft_ids": ids, "draft_convention": CONVENTIONS[convention],
            "vllm_runner": runner, "sglang_ids": s_ids, "sglang_ids_from": s_from, "sglang_rule": sp.rule,
            "vllm_ids": v_ids, "vllm_ids_from": v_from, "vllm_rule": vp.rule, "rows": rows, "notes": notes,
            "runner_note": runner_note, "differ": [r["slot"] for r in differ], "verdict": verdict,
            "fixes": fixes, "finding": "engine-id-mismatch" if differ else None}


def _verdict(rows, differ, convention: str, want, crashed=()) -> str:
    if crashed:     # an engine that raises at its first forward captures nothing: that is the difference
        other = [r["slot"] for r in differ if r["sglang"] is not None and r["vllm"] is not None]
        rest = (f"; at slot(s) {', '.join(map(str, other))} the two capture different streams" if other
                else "; every other slot is the same stream on both")
        return "; ".join(f"{name} cannot serve this draft's ids: {why}" for name, why in crashed) + rest
    d = {r["sglang"] - r["vllm"] for r in rows if r["sglang"] is not None and r["vllm"] is not None}
    complete = all(r["sglang"] is not None and r["vllm"] is not None for r in rows)
    matches = None
    if want is not None and len(want) == len(rows):
        if all(r["draft_expects"] == r["sglang"] for r in rows):
            matches = "SGLang"
        elif all(r["draft_expects"] == r["vllm"] for r in rows):
            matches = "vLLM"
    trained = {"output": "trained with the output-of-layer ids", "before": "trained with the capture-before ids"}
    if complete and d in ({1}, {-1}):
        early = d == {1}
        if matches == "SGLang" or (matches is None and early):
            head = trained[convention] if matches == "SGLang" else "trained on SGLang's slots"
            return (f"{head}: on vLLM every slot reads one layer {'early' if early else 'late'} (vLLM uses the ids "
                    f"as written, SGLang {'adds 1' if early else 'does not'}; vLLM PR #43671)")
        head = trained[convention] if matches == "vLLM" else "trained on vLLM's slots"
        return (f"{head}: on SGLang every slot reads one layer {'late' if early else 'early'} (SGLang "
                f"{'adds 1 to' if early else 'uses'} the ids, vLLM uses them as written; vLLM PR #43671)")
    slots = ", ".join(str(r["slot"]) for r in differ)
    who = f" ({matches} gives the draft what it was {trained[convention][8:]})" if matches else ""
    return (f"SGLang and vLLM capture different streams for this draft at slot(s) {slots}: they read its config "
            f"and ids differently{who}")
