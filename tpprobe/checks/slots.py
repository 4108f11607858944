"""Slots: which candidate (the embedding, a layer's stream, layer 0's input norm) each slot of the
packed aux hidden state equals, against what the layer ids ask for; the verdict names the
mistake (offset by one layer, aliased, permuted, missing, transformed)."""
from __future__ import annotations

from collections import Counter
from typing import Optional

from ..capture.points import EMBED_OUT, id_point, in_norm, layer_out, point_label, point_position
from .findings import Finding
from .layout import layout_verdict
from ..core.noise import dtype_from_str


def check_slots(ev, records, live, settings, offset_rule: bool = True) -> tuple[list[Finding], list[dict]]:
    """`offset_rule`: the engine adds 1 to an id (SGLang); False: its ids are as written (vLLM, docs/vllm.md)."""
    ids: list[int] = settings.get("layer_ids") or []
    hidden, world, L = settings["hidden"], settings["world_size"], settings.get("num_layers")
    if settings.get("expected_points") is not None:
        # arch-aware (SGLang's rules, tpprobe.engines.sglang.layer_ids.expected_slots): one point per slot in slot
        # order, then None for each id that captures nothing; expected_ids names the id of each
        expected = list(settings["expected_points"])
        ids = list(settings.get("expected_ids") or ids)[:len(expected)]
        ids += [None] * (len(expected) - len(ids))
    else:
        expected = [id_point(i) for i in ids]
    n_slots = sum(1 for e in expected if e is not None)
    if not expected or not settings.get("model_packs_aux", True):
        return [], []   # nothing to verify: the model does not pack aux hidden states itself
    findings: list[Finding] = []
    verdicts: dict[int, tuple] = {}
    rows_out: list[dict] = []
    explained: dict[int, Optional[tuple]] = {}
    dt = dtype_from_str(settings.get("dtype", "float32"))

    def cause_of(i: int) -> Optional[tuple]:
        # explain reads every live rank at once: one answer per slot, whichever rank asks
        from .causes import explain
        if i not in explained:
            explained[i] = explain(ev, records, live, hidden, i, expected[i] if i < len(expected) else None,
                                   ids[i] if i < len(ids) else None, dt)
        return explained[i]

    for r in live:
        rec = records[r]
        width = ev.packed_width(r)
        bad_layout = layout_verdict(width, rec.meta.aux, settings.get("dtype"), ids, n_slots, hidden, world)
        if bad_layout is not None and bad_layout[0] == "tp-sliced" and width % hidden == 0 \
                and _whole_slots(ev.slot_match(r, hidden)):
            # the width is both n × hidden/tp and a whole number of fewer slots (2 ids, tp 2, one slot
            # dropped): each hidden-wide slot equals a full-width capture point, so it is no TP slice;
            # the slot check below names what is missing
            bad_layout = None
        if bad_layout is not None:
            verdicts[r] = bad_layout
            continue
        from .causes import explain_rows
        rows_cause = explain_rows(records, r, hidden, expected, settings) if expected[0] else None
        if rows_cause is not None:     # F17: the aux rows of every attention-DP group
            verdicts[r] = rows_cause
            continue
        match = ev.slot_match(r, hidden)
        if match is None:
            continue
        # a slot equal to several points (a layer that added nothing leaves its stream bit for bit the one before)
        # holds its expected point when that is one of them: the match names the first in model order
        if len(match) == len(expected):
            match = [e if m is not None and e is not None and m != e and ev.points_equal(r, m, e) else m
                     for m, e in zip(match, expected)]
        if r == live[0]:
            rows_out = [{"slot": i, "id": ids[i] if i < len(ids) else None,
                         "expected": expected[i] if i < len(expected) else None, "matched": m,
                         "ok": i < len(expected) and m == expected[i],
                         "differ": ev.slot_differs(i, hidden, live)} for i, m in enumerate(match)]
        if None in match:   # a serving-path cause the all-reduce audit can name (F16, F18)
            causes = [(i, cause_of(i)) for i, m in enumerate(match) if m is None]
            cause = causes[0][1]
            if cause is not None:
                # named at the first such slot; the later ones the same cause reaches are said in its detail
                also = [c[2].split(": ", 1)[0] for _, c in causes[1:] if c is not None and c[0] == cause[0]]
                verdicts[r] = (cause[0], cause[1], cause[2] + "".join(f"; and {a}" for a in also))
                continue
        verdicts[r] = slot_verdict(ids, expected, match, L, offset_rule=offset_rule)
    # group identical verdicts
    by: dict[tuple, list[int]] = {}
    for r, v in verdicts.items():
        if v is not None:
            by.setdefault(v, []).append(r)
    for (kind, where, detail), ranks in by.items():
        findings.append(Finding(kind, where, sorted(ranks), detail=detail,
                                evidence={"all_ranks": len(ranks) == world}))
    return findings, rows_out


def _whole_slots(match) -> bool:
    """Every hidden-wide slot of the packed aux equals some full-width capture point."""
    return bool(match) and all(m is not None for m in match)


def slot_verdict(ids, expected, match, L, offset_rule: bool = True, name_ids: bool = True,
                 numbers: Optional[list[int]] = None):
    """The slot table's verdict. `offset_rule`: the engine adds 1 to an id (SGLang), so an id whose
    layer is num_layers maps past the loop; vLLM's ids are as written (its id N is valid), so a lost
    one was dropped by the engine. name_ids=False: a slot is named by its position alone (`tpprobe diff`,
    where ``ids`` are the baseline's and the target's own ids differ). `numbers`: the slot number to name
    each position by, when the lists hold some of a table's slots only (default: the position)."""
    def lab(p):
        return point_label(p) if p else "no candidate"

    def num(i):
        return numbers[i] if numbers is not None and i < len(numbers) else i

    if len(match) < len(expected):
        have = set(match)
        lost = [i for i, e in zip(ids, expected) if e not in have]
        if lost and all(m in expected for m in match):
            why = []
            for i in lost:
                why.append(f"id {i} produced no capture" + (
                    (f": it maps to layer {i + 1} = num_layers, past the last layer, and is silently dropped"
                     if offset_rule else
                     ": a valid id (the engine's ids are as written) that the engine's loop never offered to "
                     "its capture")
                    if L is not None and i + 1 >= L else ""))
            return ("missing-capture", f"aux slot for id {lost[0]}" if len(lost) == 1 else f"aux slots for ids {lost}",
                    "; ".join(why) + f" ({len(match)} of {len(expected)} slots present)")
    if match == expected:
        return None
    wrong = [i for i, (m, e) in enumerate(zip(match, expected)) if m != e]
    where = f"aux slot {num(wrong[0])}" if len(wrong) == 1 else f"aux slots {[num(i) for i in wrong]}"

    def slot(i):
        if not name_ids or i < len(ids) and ids[i] is None:      # no id of its own (a draft with none)
            return f"slot {num(i)}"
        return f"slot {num(i)} (id {ids[i] if i < len(ids) else '?'})"

    text = "; ".join(f"{slot(i)} equals {lab(match[i])}, expected "
                     f"{lab(expected[i]) if i < len(expected) else 'nothing'}" for i in wrong)
    dup = [m for m, c in Counter(m for m in match if m).items() if c > 1]
    if dup:
        last = max(dup, key=lambda m: point_position(m) or -9)
        same = [num(i) for i, m in enumerate(match) if m == last]
        return ("aliased-capture", f"aux slots {same}", f"slots {same} all hold {lab(last)}: captured without clone() "
                                          f"from a buffer that later layers overwrote")
    deltas = {(point_position(match[i]) - point_position(expected[i]))
              if match[i] and point_position(match[i]) is not None and i < len(expected) and expected[i]
              and point_position(expected[i]) is not None else None for i in wrong}
    # every slot but the embedding's shifted alike: the id rule (the embedding's id -1 has no +1 to get wrong)
    every = len(deltas) == 1 and next(iter(deltas)) in (-1.0, 1.0) and \
        all(i in wrong for i, e in enumerate(expected) if e != EMBED_OUT) and len(wrong) > 1
    emb = next((i for i in wrong if expected[i] == EMBED_OUT and match[i] in (in_norm(0), layer_out(0))), None)
    if emb is not None and not every:
        # the embedding's slot alone holds something after it: a transform (layer 0's input norm) or the
        # first decoder layer's output, one layer late; the other slots are right, so no id rule shifted them
        what = ("the capture is taken after a transform" if match[emb] == in_norm(0) else
                "the \"embedding\" is taken after the first decoder layer ran: a transformed capture, one layer late")
        return ("transformed-capture", f"aux slot {num(emb)}", f"slot {num(emb)} equals {lab(match[emb])}, expected "
                                                               f"the raw embedding ({what})")
    if len(deltas) == 1 and next(iter(deltas)) in (-1.0, 1.0):
        d = next(iter(deltas))
        why = ""
        if every and offset_rule:     # every slot shifted alike: the id rule, not one capture
            why = f" (the EAGLE-3 +1 was {'not applied' if d < 0 else 'applied twice'})"
        elif every:
            why = " (the ids are read in the other convention: output-of-layer vs capture-before)"
        return ("capture-offset", where, f"{text}: one layer {'early' if d < 0 else 'late'}{why}")
    if set(match) == set(expected) and None not in match and \
            match == sorted(expected, key=lambda p: point_position(p) if point_position(p) is not None else 1e9):
        return ("slot-mismatch", where, f"the ids {ids} are not in layer order, but the model appends each "
                                        f"capture as its layer runs, so the slots follow layer order: {text}; "
                                        f"give the ids in layer order (and train the draft on that order)")
    if set(match) == set(expected):
        return ("slot-mismatch", where, f"slots are permuted: {text}")
    extra = [m for m in match if m not in expected]
    msg = f"{text}"
    if EMBED_OUT in expected and EMBED_OUT not in match:
        msg += f"; the embedding slot is missing and {lab(extra[-1]) if extra else 'another layer'} was captured"
    return ("slot-mismatch", where, msg)
