"""The drafter's input against the draft, and vLLM's acceptance beside it: `tpprobe report DIR` of a live capture.

Reads what tpprobe.engines.vllm.drafter wrote (DIR/dp{D}-pp{P}/step-N-MODE/drafter/rank-R.json, the
group's acceptance.json) and judges, per captured step:

* cross-rank: every TP rank's `target_hidden_states` (its fingerprint) equals TP rank 0's;
* layout: width = (ids vLLM captures) × hidden, the target's dtype, contiguous; an id of the draft's config
  past the last layer (vLLM drops it at load: the draft's fc then fails at its first draft step, F31);
* the engine's rule: slot s holds the s-th smallest id's stream (vLLM sorts and de-duplicates the draft
  config's `eagle_aux_hidden_state_layer_ids`; id k = the stream entering layer k = HF hidden_states[k],
  id N the last layer's output before the final norm) — what each slot holds was measured live against the
  same forward's streams, so a capture without the residual or another layer's stream is named;
* the draft: what it was trained on, when the user says it (TPPROBE_DRAFT_TRAINED, at capture or report
  time): `ids:A,B,C` (HF hidden_states indices in slot order), or `convention:NAME` applied to the config's
  ids as written — `output` (SpecForge's: id k = HF hidden_states[k+1]), `before` (id k = hidden_states[k],
  in the written order), `vllm` (vLLM's own rule: sorted, as written), or `specforge:PATH`, a SpecForge
  training sample whose slots are matched to the streams TP rank 0 kept of a captured prefill of the same
  tokens (tpprobe.engines.draft_training.match_sample). Without it the slots are checked
  against the draft's config only, and a warning says so: the engine agreeing with itself is no evidence
  that the draft gets what it was trained on.

Acceptance is vLLM's own (the rejection sampler's verification, counted by the plugin): drafts, draft tokens,
accepted tokens per position, rate (accepted / draft tokens), mean acceptance length (1 + accepted / drafts),
per captured step and for the run so far. Python over the plugin's files (JSON; safetensors for a SpecForge
sample's match): no vllm import.
"""
from __future__ import annotations

from tpprobe.config.knobs import knob

import json
from pathlib import Path
from typing import Optional

from tpprobe.checks.findings import FAILURE, WARNING, Finding
from tpprobe.core.errors import UsageError
from tpprobe.engines.draft_training import slot_count_mismatch

FIELD = "eagle_aux_hidden_state_layer_ids"
LOW = 0.5             # a rate under this is "low": the report looks for its cause and proposes a fix
SAME = 1e-6           # fingerprint relative difference between ranks still called equal (float32 sums)
CONVENTIONS = ("output", "before", "vllm")
TRAINED_EXPLAIN = ("the engine captures exactly what the draft's config says, but the config is not what the draft "
                   "was trained on (catalogue F32): vLLM uses the ids as written (id k = HF hidden_states[k]) and "
                   "fills the slots in ascending id order; SpecForge's output-of-layer ids are one less")
ORDER_EXPLAIN = ("the draft's ids are written out of layer order (catalogue F30): vLLM sorts and de-duplicates "
                 f"`{FIELD}` and fills the slots in ascending id order, so a draft trained with its slots in the "
                 "written order reads another stream in every slot the sort moves, with no error; no id list gives "
                 "the written order: permute the draft's fc.weight column blocks to layer order, or retrain")
GAIN = 0.05           # first-position acceptance a replayed capture must gain to count (tpprobe.eagle3.fix's GAIN)


def drafter_files(root: Path) -> list[Path]:
    return sorted(Path(root).rglob("drafter/rank-*.json"))


def _load(p: Path) -> Optional[dict]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def rates(acc: dict) -> dict:
    """vLLM's acceptance numbers with the rate, mean acceptance length and per-position rates."""
    drafts, tokens, accepted = acc.get("drafts", 0), acc.get("draft_tokens", 0), acc.get("accepted", 0)
    per = list(acc.get("accepted_per_pos") or [])
    return {**acc, "rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "rate_per_pos": [x / drafts for x in per] if drafts else []}


def trained_slots(spec: Optional[str], config_ids: list[int], forwards=None) -> tuple[Optional[list[int]], str]:
    """(HF hidden_states index per slot the draft was trained on, how it was given); (None, why) when unknown.
    `forwards()`: the captured prefills (token ids, {HF index: stream}, where) a `specforge:PATH` sample's slots
    are matched to (tpprobe.engines.draft_training.match_sample)."""
    if not spec:
        return None, "not given (TPPROBE_DRAFT_TRAINED)"
    kind, _, val = spec.partition(":")
    if not val:
        kind, val = "ids", spec
    kind = kind.strip().lower()
    if kind == "ids":
        try:
            return [int(x) for x in val.split(",") if x.strip()], f"TPPROBE_DRAFT_TRAINED={spec}"
        except ValueError:
            raise UsageError(f"TPPROBE_DRAFT_TRAINED={spec!r}: ids:A,B,C takes integers (HF hidden_states indices "
                             f"in slot order)")
    if kind == "convention":
        c = val.strip().lower()
        if c == "output":
            return [i + 1 for i in config_ids], f"the draft's ids {config_ids} read as SpecForge's output-of-layer " \
                                                f"convention (id k = HF hidden_states[k+1])"
        if c == "before":
            return list(config_ids), f"the draft's ids {config_ids} read as capture-before (id k = hidden_states[k])"
        if c == "vllm":
            return sorted(set(config_ids)), f"the draft's ids {config_ids} under vLLM's rule (sorted)"
        raise UsageError(f"TPPROBE_DRAFT_TRAINED={spec!r}: conventions are {', '.join(CONVENTIONS)}")
    if kind == "specforge":
        from tpprobe.engines.draft_training import match_sample
        return match_sample(val.strip(), forwards() if forwards is not None else [])
    raise UsageError(f"TPPROBE_DRAFT_TRAINED={spec!r}: give ids:A,B,C (HF hidden_states indices in slot order), "
                     f"convention:{'|'.join(CONVENTIONS)} or specforge:PATH (a SpecForge training sample)")


def _hf(i) -> str:
    return f"HF hidden_states[{i}]"


def _held(slot: dict, L) -> str:
    h = slot.get("holds")
    if h is None:
        return f"no stream of this forward (nearest: {slot.get('best')}, rel diff² {slot.get('rel'):.2g})" \
            if slot.get("best") else "no stream of this forward"
    if h.startswith("id "):
        k = int(h.split()[1])
        return f"id {k} = {_hf(k)}" + (" (the embedding)" if k == 0 else f" (layer {k - 1}'s output"
                                       + (", before the final norm)" if k == L else ")"))
    return h


def fix_for(trained: list[int], L: int) -> tuple[Optional[list[int]], str]:
    """The ids that give a draft trained on `trained` its slots on vLLM, or (None, what to do instead)."""
    if any(i < 0 or i > L for i in trained):
        bad = [i for i in trained if i < 0 or i > L]
        return None, (f"no id list gives {', '.join(_hf(i) for i in bad)} on vLLM (ids 0..{L}: the embedding .. "
                      f"the last layer's output before the final norm)")
    if len(set(trained)) != len(trained):
        return None, "the draft reads one stream in two slots: vLLM captures an id once (it de-duplicates)"
    if trained != sorted(trained):
        return None, (f"the draft reads its slots in the order HF hidden_states{trained} and vLLM fills slots in "
                      f"ascending id order: no id list gives that order; write `{FIELD}` as {sorted(trained)} and "
                      f"permute the column blocks of the draft's fc.weight to it (slot order {sorted(trained)}: "
                      f"take blocks {[trained.index(i) for i in sorted(trained)]} of the trained order), or "
                      f"retrain with the ids in layer order")
    return list(trained), f"set `{FIELD}` to {trained}"


def analyse(root: Path, trained_spec: Optional[str] = None, skip: frozenset = frozenset()) -> Optional[dict]:
    """The drafter section of `tpprobe report DIR` (None when DIR holds no drafter capture); `skip`: step folders
    not to read (an earlier server's, tpprobe/cli/steps.py latest_run)."""
    files = [f for f in drafter_files(root) if str(f.parent.parent) not in skip]
    if not files:
        return None
    steps: dict[Path, dict] = {}
    for p in files:
        m = _load(p)
        if m is None:
            continue
        steps.setdefault(p.parent.parent, {})[int(m.get("tp_rank", 0))] = m
    groups = sorted({d.parent for d in steps})
    acc_run = {}
    for g in groups:
        a = _load(g / "acceptance.json")
        if a is not None:
            # a step folder reported alone: its group's file is above it
            acc_run[g.relative_to(root).as_posix() if g != root and g.is_relative_to(root) else "."] = rates(a)
    rows, findings = [], []
    first_by_kind: dict = {}
    spec = trained_spec if trained_spec is not None else knob("TPPROBE_DRAFT_TRAINED")
    trained, trained_from = None, "not given (TPPROBE_DRAFT_TRAINED)"
    recorded = False          # the training as the plugin recorded it at capture, not given here
    meta0 = None
    for d in sorted(steps, key=lambda d: (steps[d][min(steps[d])].get("step", 0), str(d))):
        ranks = steps[d]
        m = ranks[min(ranks)]
        if m.get("streams_seen"):
            meta0 = meta0 or m
        if not spec and m.get("trained"):
            spec, recorded = m["trained"], True
        if not spec and m.get("trained_refused") and trained_from.startswith("not given"):
            trained_from = f"refused at capture, not used: {m['trained_refused']}"
        config_ids = list(m.get("draft_config_ids") or [])
        if trained is None and spec and trained_from == "not given (TPPROBE_DRAFT_TRAINED)":
            trained, trained_from = trained_slots(spec, config_ids, lambda: captured_prefills(steps))
            if trained is not None and (why := slot_count_mismatch(spec, trained, config_ids, m.get("n_slots"),
                                                                   FIELD, "the slots the drafter received")):
                if not recorded:        # given here: one line, exit 2
                    raise UsageError(why)
                # recorded by a plugin that did not check it: not used, said, and the report goes on
                trained, trained_from = None, f"refused at capture, not used: {why}"
        L = m.get("num_layers")
        step, mode = m.get("step"), m.get("forward_mode")
        held = [s.get("id") for s in m.get("slots") or []]
        expected = sorted({i for i in config_ids if L is None or 0 <= i <= L})
        where_step = f"step {step} ({mode})"
        # cross-rank equality of what the drafter receives
        fp0 = m.get("fingerprint") or {}
        differ = []
        for r, x in sorted(ranks.items()):
            fp = x.get("fingerprint") or {}
            if r == min(ranks) or not fp0:
                continue
            den = abs(fp0.get("sumsq", 0)) + abs(fp.get("sumsq", 0)) or 1.0
            sk = [abs(a - b) for a, b in zip(fp0.get("sketch", []), fp.get("sketch", []))]
            if abs(fp0.get("sumsq", 0) - fp.get("sumsq", 0)) / den > SAME or (sk and max(sk) ** 2 / den > SAME) \
                    or x.get("width") != m.get("width"):
                differ.append(r)
        tp = int(m.get("tp_size") or len(ranks))
        if len(ranks) < tp:
            _add(findings, first_by_kind, Finding(
                "capture-file", f"drafter input, {where_step}", sorted(set(range(tp)) - set(ranks)), detail=(
                    f"ranks {sorted(set(range(tp)) - set(ranks))} wrote no drafter file for this step")))
        partial = partial_slots(ranks) if differ else []
        if partial:
            js = [j for j, _ in partial]
            _add(findings, first_by_kind, Finding(
                "partial-capture", f"{_slots_text(js)}, {where_step}", sorted(ranks), detail="; ".join(
                    f"slot {j} ({_held({'holds': f'id {k}'}, L) if k is not None else 'its stream'}) holds each "
                    f"rank's own partial sum: its hidden_states part differs across ranks {sorted(ranks)} while the "
                    f"residual it is added to is equal" for j, k in partial) + (
                    " — a capture before the layer's reduce completed (catalogue F16 / F28: a deferred or fused "
                    "all-reduce): every rank's draft gets another input and none gets the stream; fix: capture "
                    "the layer's output after its reduce completes (vLLM's EagleModelMixin._maybe_add_hidden_state "
                    "must see the reduced hidden_states)"), evidence={"all_ranks": True}))
        elif differ:
            _add(findings, first_by_kind, Finding(
                "rank-divergence", f"drafter input (target_hidden_states), {where_step}", differ,
                detail=f"what the draft receives differs from TP rank {min(ranks)}'s on ranks {differ} "
                       f"(fingerprints of the whole [{m.get('rows')} × {m.get('width')}] tensor)"))
        # layout
        hidden, width = m.get("hidden") or 0, m.get("width") or 0
        past = [i for i in config_ids if L is not None and (i > L or i < 0)]
        if hidden and width != len(expected) * hidden or past or (hidden and width != len(config_ids) * hidden):
            detail = (f"target_hidden_states is {width} wide = {width / hidden if hidden else '?':g} × hidden {hidden};"
                      f" the draft's fc reads {len(config_ids)} × {hidden} = {len(config_ids) * hidden}")
            if past:
                detail += (f": id(s) {past} of the draft's config are past the last layer ({L} layers: ids 0..{L}); "
                           f"vLLM dropped them at load without a word and the draft's fc fails at its first draft "
                           f"step; fix: ids within 0..{L}")
            elif len(set(config_ids)) != len(config_ids):
                detail += f": the config repeats an id ({config_ids}); vLLM captures each id once"
            _add(findings, first_by_kind, Finding("layout-mismatch", f"drafter input, {where_step}",
                                                  sorted(ranks), detail=detail, evidence={"all_ranks": True}))
        # the engine's own rule: what each slot holds vs the sorted ids (only where the forward's streams were
        # seen: a forward replayed from a CUDA graph runs no hooks)
        nores, other = [], []
        for s in (m.get("slots") or []) if m.get("streams_seen") else []:
            j = s["slot"]
            want = expected[j] if j < len(expected) else None
            if s.get("holds") and "without the residual" in s["holds"]:
                nores.append(f"slot {j} holds layer {int(s['holds'].split()[1])}'s hidden_states without the residual "
                             f"where vLLM's rule gives id {want} = {_hf(want)}")
            elif s.get("id") != want:
                other.append((j, f"slot {j} holds {_held(s, L)}, where vLLM's rule for the draft's ids {config_ids} "
                                 f"gives id {want}"))
        if nores:
            js = [int(x.split()[1]) for x in nores]
            _add(findings, first_by_kind, Finding(
                "capture-no-residual", f"{_slots_text(js)}, {where_step}", sorted(ranks),
                detail="; ".join(nores) + " (hidden_states + residual); fix: the capture must append hidden_states "
                                          "+ residual (vLLM's EagleModelMixin._maybe_add_hidden_state)",
                evidence={"all_ranks": True}))
        if other:
            _add(findings, first_by_kind, Finding(
                "slot-mismatch", f"{_slots_text([j for j, _ in other])}, {where_step}", sorted(ranks),
                detail="; ".join(t for _, t in other), evidence={"all_ranks": True}))
        step_acc = rates({"drafts": sum(1 for x in (m.get("acceptance") or {}).get("num_draft_tokens", []) if x),
                          "draft_tokens": sum((m.get("acceptance") or {}).get("num_draft_tokens", [])),
                          "accepted": sum((m.get("acceptance") or {}).get("accepted", [])),
                          "accepted_per_pos": (m.get("acceptance") or {}).get("accepted_per_pos", [])}) \
            if m.get("acceptance") else None
        rows.append({"folder": str(d), "step": step, "forward_mode": mode, "rows": m.get("rows"),
                     "width": width, "ranks": sorted(ranks), "ranks_differ": differ, "slots": m.get("slots"),
                     "requests": m.get("requests"), "acceptance": step_acc, "kept": m.get("kept"),
                     "engine_ids": m.get("engine_ids"), "config_ids": config_ids})
    if meta0 is None:      # no captured step saw the target's streams: layout, ranks and acceptance only
        last = steps[sorted(steps)[-1]]
        meta0 = dict(last[min(last)], slots=[])
        findings.append(Finding("coverage", "drafter slots", sorted(last), severity=WARNING, detail=(
            "no captured step saw the target's layer streams (forwards replayed from a CUDA graph run no hooks): "
            "the slots are not matched to layers; capture eager steps (--enforce-eager) to check them"),
            evidence={"all_ranks": True}))
    config_ids = list(meta0.get("draft_config_ids") or [])
    L = meta0.get("num_layers")
    held = [s.get("id") for s in meta0.get("slots") or []]
    run = next(iter(acc_run.values()), None) if acc_run else None
    rate = run.get("rate") if run else None
    low = rate is not None and rate < LOW
    fix_ids, fix_text = (None, None)
    fix_finding = None
    first = rows[0]
    where0 = f"step {first['step']} ({first['forward_mode']})"
    ranks_all = first["ranks"]
    if not meta0.get("slots"):
        pass
    elif trained is None:
        said = "" if trained_from.startswith("not given") else f" ({trained_from})"
        findings.append(Finding("coverage", "drafter input vs the draft's training", ranks_all, severity=WARNING,
                                detail=(f"checked against the draft's config only: vLLM gives slots {held} for its "
                                        f"ids {config_ids}, but nothing says the draft was trained on "
                                        f"{', '.join(_hf(i) for i in held)}{said}; set TPPROBE_DRAFT_TRAINED=ids:A,B,C "
                                        f"(HF hidden_states per slot), convention:output|before|vllm or "
                                        f"specforge:PATH"),
                                evidence={"all_ranks": True}))
    elif held != trained and None not in held and len(held) == len(trained):
        # (a slot holding no id, or fewer slots than ids, as when vLLM drops an id past the last layer: the engine's
        # own fault, named above)
        fix_ids, fix_text = fix_for(trained, int(L or 0))
        wrong = [j for j, (h, t) in enumerate(zip(held, trained)) if h != t]
        d = {h - t for h, t in zip(held, trained) if h is not None and h != t}
        what = "; ".join(f"slot {j} holds {_hf(held[j])}, trained on {_hf(trained[j])}" for j in wrong)
        explain = TRAINED_EXPLAIN
        if sorted(held) == sorted(trained) and config_ids == trained:
            kind, why = "slot-mismatch", (f"the draft's ids {config_ids} are not in layer order and vLLM sorts them "
                                          f"(catalogue F30): {what}")
            explain = ORDER_EXPLAIN
        elif len(d) == 1 and next(iter(d)) in (-1, 1) and len(wrong) == len(held):
            kind, why = "capture-offset", (f"every slot is one layer {'early' if d == {-1} else 'late'} against what "
                                           f"the draft was trained on ({trained_from}): {what}")
        else:
            kind, why = "id-contract", f"the draft's config is not what it was trained on ({trained_from}): {what}"
        acc_text = (f"; it explains vLLM's acceptance {rate:.2f} (mean acceptance length "
                    f"{run['mean_acceptance_length']:.2f})" if rate is not None and low else
                    (f"; vLLM's acceptance is {rate:.2f} all the same (the draft may not read these slots)"
                     if rate is not None else ""))
        findings.append(Finding(kind, f"{_slots_text(wrong)}, {where0}", ranks_all,
                                detail=f"{why}{acc_text}; fix: {fix_text}", evidence={"all_ranks": True,
                                                                                   "explain": explain}))
        # the replay of the draft (tpprobe/cli/drafter.py) may run after this: replayed_fix says what it found
        fix_finding = {"kind": kind, "where": findings[-1].where, "head": f"{why}{acc_text}"}
    fails = [f for f in findings if f.severity == FAILURE]
    if low and fails and not any("explains vLLM's acceptance" in f.detail for f in fails):
        f0 = fails[0]
        f0.detail += f"; it explains vLLM's acceptance {rate:.2f} (mean acceptance length " \
                     f"{run['mean_acceptance_length']:.2f})"
    if low and not fails:
        findings.append(Finding("acceptance-low", "vLLM's acceptance", ranks_all, severity=WARNING, detail=(
            f"acceptance {rate:.2f} (mean acceptance length {run['mean_acceptance_length']:.2f}) and the draft's input "
            f"passes every check here" + ("" if trained is not None else " against its config") +
            ": the drafter section's replay of the draft on candidate captures says which would serve it; or "
            "check what it was trained on"),
            evidence={"all_ranks": True, "explain": "low acceptance with a healthy input: the draft itself, its "
                                                    "training data, or sampling settings"}))
    return {"steps": rows, "acceptance": acc_run, "run": run, "low": low, "config_ids": config_ids,
            "engine_slots": held, "trained": trained, "trained_from": trained_from, "num_layers": L,
            "draft_model": meta0.get("draft_model"), "target_arch": meta0.get("target_arch"),
            "target_model": meta0.get("target_model"), "fix_ids": fix_ids, "fix": fix_text,
            "fix_ids_from": "training" if fix_ids is not None else None,
            "fix_finding": fix_finding,
            "findings": [f.to_json() for f in findings],
            "explained": bool(low and fails)}


def _gain(cur: dict, sc: dict) -> str:
    return (f"first-position acceptance {cur['first_position']:.2f} -> {sc['first_position']:.2f} (accept length, "
            f"chain of {sc['chain']}: {cur['accept_length']:.2f} -> {sc['accept_length']:.2f})")


def replayed_fix(a: dict) -> None:
    """After the draft's replay (a["replay"], tpprobe/cli/drafter.py replay_fix): the fix of the finding made from
    the training says what the replay found, so the two never contradict each other in one report; a["fix"] is
    that text and a["fix_replayed"] True. Nothing changes when no replay ran or the training gave ids the replay
    confirms."""
    ff, rp = a.get("fix_finding"), a.get("replay") or {}
    if not ff or not rp.get("available"):
        return
    f = next((x for x in a["findings"] if x["kind"] == ff["kind"] and x["where"] == ff["where"]), None)
    if f is None:
        return
    where = rp.get("where") or rp.get("on")
    cur = rp["current"]["score"]
    best, chk, perm = rp["best"], rp.get("fix_check"), rp.get("permute_check")
    trained = a["trained"]
    if a.get("fix_ids") is not None:
        if chk is None or chk["score"]["first_position"] > chk["current"]["first_position"] + GAIN or \
                not rp.get("explained"):
            return          # the replay confirms the training's ids (the fix line shows it), or finds nothing better
        fix = (f"{a['fix']} (what the training says; but replayed on {where}, these ids give "
               f"{_gain(chk['current'], chk['score'])}, and the replay finds: {rp['line']})")
    else:
        order = sorted(trained) != trained and len(set(trained)) == len(trained)
        head = (f"no id list reproduces the training order HF hidden_states{trained} on vLLM (it fills the slots in "
                f"ascending id order)" if order else a["fix"])
        if rp.get("fix_ids") is not None and rp.get("explained"):
            fix = (f"{head}; replayed on {where}, ids {rp['fix_ids']} give {_gain(cur, best['score'])}: set "
                   f"`{FIELD}` to {rp['fix_ids']}")
            # the ids to write are the replay's: fix_ids says so too, for whoever reads the JSON and not the line
            a["fix_ids"], a["fix_ids_from"] = list(rp["fix_ids"]), "replay"
        elif rp.get("explained"):
            fix = (f"{head}; replayed on {where}, no id list serves the draft either (it replays best on HF "
                   f"hidden_states{best['streams']}, {best['score']['first_position']:.2f} first-position "
                   f"acceptance, which no id list gives on vLLM)")
        else:
            fix = f"{head}; replayed on {where}: {rp['line']}"
        if order:
            srt = sorted(trained)
            served = rp.get("fix_ids") is not None and rp.get("explained")
            fix += ("; or " if served else "; ") + (
                f"write `{FIELD}` as {srt} and permute the column blocks of the draft's fc.weight to it (take blocks "
                f"{[trained.index(i) for i in srt]} of the trained order"
                + (f"; so permuted, the draft replays {_gain(perm['current'], perm['score'])}" if perm else "")
                + "), or retrain with the ids in layer order")
    f["detail"] = f"{ff['head']}; fix: {fix}"
    f["line"] = Finding(f["kind"], f["where"], f["ranks"], f["severity"], f["detail"], f.get("evidence") or {}).line
    a["fix"], a["fix_replayed"] = fix, True


def _vdiff(a: list, b: list) -> float:
    den = sum(x * x for x in a) + sum(y * y for y in b)
    return sum((x - y) ** 2 for x, y in zip(a, b)) / den if den else 0.0


def partial_slots(ranks: dict) -> list:
    """[(slot, id)] of the slots every rank holds differently while the residual under them (the slot's sketch
    minus its hidden_states part's, linear) is the same on every rank: each rank's own partial sum of that
    layer's output. [] unless every slot that differs across ranks is one."""
    per = {r: {s["slot"]: s for s in (m.get("slots") or [])} for r, m in ranks.items()}
    r0 = min(per)
    out, other = [], False
    for j, s0 in sorted(per[r0].items()):
        rows = [per[r].get(j) for r in sorted(per)]
        if any(x is None or x.get("sketch") is None for x in rows):
            continue
        if all(_vdiff(s0["sketch"], x["sketch"]) <= SAME for x in rows):
            continue
        if any(x.get("hidden_sketch") is None for x in rows):
            other = True
            continue
        res = [[a - b for a, b in zip(x["sketch"], x["hidden_sketch"])] for x in rows]
        if all(_vdiff(res[0], x) <= SAME for x in res):
            out.append((j, s0.get("id")))
        else:
            other = True
    return [] if other else out


def _slots_text(js: list) -> str:
    return f"drafter slot {js[0]}" if len(js) == 1 else f"drafter slots {js}"


def _add(findings: list, first: dict, f: Finding) -> None:
    """One finding per kind: the first step it occurs in (later steps: counted in its detail)."""
    key = (f.kind, f.where.split(",")[0])
    if key in first:
        first[key]["n"] += 1
        return
    first[key] = {"n": 1}
    findings.append(f)


def captured_prefills(steps: dict) -> list:
    """(token ids, {HF index: stream}, where) of every prefill request whose streams TP rank 0 kept, in step
    order: what a SpecForge sample's slots are matched to. `steps`: step folder -> {rank: drafter meta}."""
    from safetensors.torch import load_file

    out = []
    for d in sorted(steps, key=lambda d: (steps[d][min(steps[d])].get("step", 0), str(d))):
        m = steps[d][min(steps[d])]
        f = d / "drafter" / "rank-000.safetensors"
        if not m.get("kept") or not f.is_file():
            continue
        t = load_file(str(f))
        if "target_token_ids" not in t:
            continue
        for r in m.get("requests") or []:
            lo, hi = r["rows"]
            if r.get("kind") == "prefill" and hi > lo:
                by = {int(k.split(".")[1]): v[lo:hi] for k, v in t.items() if k.startswith("stream.")}
                out.append((t["target_token_ids"][lo:hi], by, f"step {m.get('step')} ({m.get('forward_mode')}), "
                                                              f"request {r['index']}'s prompt rows {lo}..{hi - 1}"))
    return out
