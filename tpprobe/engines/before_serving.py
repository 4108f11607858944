"""Two silent failures a draft's config causes, named before serving, per engine and per vLLM model runner.

* ids not in layer order (catalogue F30): both engines fill the aux slots in ascending layer order
  (vLLM sorts the ids; SGLang appends during its forward loop), so a draft trained with its slots in
  the written order reads another layer in every slot the sort moves: acceptance near 0, no error.
* an id beyond the last layer (F31): vLLM drops it at load without a word, and the engine dies at its
  first draft step in the draft's `fc` (`shape '[-1, K*hidden]' is invalid`: the packed aux is one
  slot short); SGLang's loop never reaches it (its Llama family drops it the same way, its packer
  families raise 'captured n of K aux hidden states' at the first forward).

`findings(draft, arch, num_layers, hidden, id_rule)` -> one dict per (engine, runner, fault) with the
line to print; the ids are read as each engine's target side reads them (SGLang: the nested
`eagle_config` ids only; vLLM: its v1 and v2 model runners' readers). Pure Python, no engine import.
"""
from __future__ import annotations

from typing import Optional


def _readers(draft: dict) -> list[tuple[str, str, Optional[list[int]], str]]:
    from tpprobe.engines.ids_compare import sglang_config_ids
    from tpprobe.engines.vllm.layer_ids import config_ids
    s_ids, s_from = sglang_config_ids(draft)
    v1, v1_from = config_ids(draft, "v1")
    v2, v2_from = config_ids(draft, "v2")
    out = [("sglang", "SGLang", s_ids, s_from)]
    if v1 == v2:
        out.append(("vllm", "vLLM (v1 and v2 model runners)", v1, v1_from))
    else:
        out += [("vllm", "vLLM (v1 model runner, CPU)", v1, v1_from), ("vllm", "vLLM (v2 model runner, GPU default)",
                                                                       v2, v2_from)]
    return out


def findings(draft: dict, arch: str, num_layers: int, hidden: Optional[int] = None,
             id_rule: Optional[dict] = None, rule_engines: Optional[set] = None) -> list[dict]:
    """`id_rule` (a patched build) applies to the engines in `rule_engines` (default: both)."""
    from tpprobe.engines.capture_rule import plan_for
    from tpprobe.core.errors import UsageError
    out = []
    N = int(num_layers)
    for engine, who, ids, where in _readers(draft):
        if not ids:
            continue
        try:
            p = plan_for(engine, arch, ids, N, id_rule if rule_engines is None or engine in rule_engines else None)
        except UsageError:          # an architecture this engine does not know: the engines' view says so
            continue
        rows = [r for r in p.rows if r.requested is not None]
        held = [r for r in rows if r.slot is not None and r.status == "ok"]      # written order
        in_slots = sorted(held, key=lambda r: r.slot)
        if [id(r) for r in held] != [id(r) for r in in_slots]:
            parts = [f"slot {j} holds id {a.requested}'s capture (HF hidden_states[{a.hf_index}]) instead of id "
                     f"{b.requested}'s (HF hidden_states[{b.hf_index}])" for j, (a, b) in enumerate(zip(in_slots, held))
                     if a is not b]
            order = sorted(ids)
            now = [r.hf_index for r in in_slots]
            q = plan_for(engine, arch, order, N, id_rule if rule_engines is None or engine in rule_engines else None)
            alt = None if q.crash or q.problems else q.slot_hf_indices
            if alt == now:
                tail = (f"write {order} and permute the draft's fc.weight column blocks the same way (or just {order} "
                        f"if it was trained in layer order)")
            else:
                tail = (f"unless the draft was trained in layer order: this engine's rule reads the list's order "
                        f"(written as {order} the ids give "
                        f"{'HF hidden_states' + str(alt) if alt else 'a crash or a dropped id'}), so the order may be "
                        f"on purpose; tpprobe fix tells which from the draft's weights")
            out.append({"engine": engine, "who": who, "fault": "F30", "kind": "ids-out-of-order", "ids": ids,
                        "line": f"{who}: ids {ids} ({where}) are not in layer order: the engine fills the slots in "
                                f"ascending layer order, so {'; '.join(parts)}; a draft trained with the slots in the "
                                f"written order accepts almost nothing, with no error — {tail}"})
        limit = N if engine == "vllm" else N - 1      # the last capture point each engine's loop reaches
        for r in rows:
            if r.status not in ("dropped", "crash") or r.layer is None or r.layer <= limit:
                continue
            width = f"[-1, {len(rows) * hidden}]" if hidden else "[-1, K*hidden]"
            if engine == "vllm" and r.status == "crash":       # the id itself makes vLLM raise at load
                what = f"vLLM refuses the draft at load: {p.crash}"
            elif engine == "vllm":
                what = (f"vLLM's ids go up to {N} (the last layer's output): it drops id {r.requested} at load "
                        f"without a word, and the engine starts and dies at its first draft step in the draft's fc "
                        f"(shape '{width}' is invalid: the packed aux is one slot short)")
            elif p.crash and "AuxHiddenStatePacker" in p.crash:
                what = (f"SGLang's loop (layers 0..{N - 1}) never reaches layer {r.layer}: the engine starts and "
                        f"dies at its first forward ({p.crash})")
            else:
                what = (f"SGLang's loop (layers 0..{N - 1}) never reaches layer {r.layer}: it drops the id without "
                        f"a word, and the engine dies at its first draft step in the draft's fc (shape '{width}' is "
                        f"invalid: the packed aux is one slot short)")
            out.append({"engine": engine, "who": who, "fault": "F31", "kind": "id-beyond-last-layer", "ids": ids,
                        "line": (f"{who}: id {r.requested} ({where}) is beyond the last layer of this {N}-layer "
                                 f"target: {what}" if engine == "vllm" else
                                 f"{who}: id {r.requested} ({where}) points past the last layer SGLang's loop reaches "
                                 f"on this {N}-layer target: {what}")})
    return out
