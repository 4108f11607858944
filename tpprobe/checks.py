"""The checks: from what every rank captured to a short list of findings.

`run_checks(records, settings, liveness, references)` is the one entry point, used online (rank 0
after the exchange) and offline (`tpprobe report DIR`). It measures, then diagnoses:

  measure   cross-rank: every capture point of every rank against the reference rank
            allreduce-complete: every audited all-reduce output against Σ_ranks of its inputs
            layout: width, dtype, contiguity, finite values of the packed aux tensor and slots
            slots: which candidate (embedding, a layer's stream, layer 0's input norm) each slot equals
  diagnose  the root cause in model order; what follows from it is listed under it as
            consequences, never as separate failures.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from .capture import RankRecord
from .compare import compare, dtype_from_str
from .evidence import LEVELS, TensorEvidence
from .findings import FAILURE, INFO, WARNING, Finding


def point_layer(name: str) -> Optional[int]:
    parts = name.split(".")
    if parts[0] == "layer" and len(parts) > 1 and parts[1].lstrip("-").isdigit():
        return int(parts[1])
    return -1 if name.startswith("embed") else None


def id_point(layer_id: int) -> str:
    return "embed.out" if layer_id == -1 else f"layer.{layer_id}.out"


def point_label(name: str) -> str:
    if name == "embed.out":
        return "the embedding"
    if name == "embed.local":
        return "the embedding's local (pre-reduce) output"
    if name.endswith(".in_norm"):
        return f"layer {point_layer(name)}'s input norm output"
    return f"layer {point_layer(name)}'s output" if point_layer(name) is not None else name


def stream_order(names) -> list[str]:
    """embed.out, then layer.K.out in K order (the residual stream in model order)."""
    layers = sorted((point_layer(n), n) for n in names if n.startswith("layer.") and n.endswith(".out"))
    return (["embed.out"] if "embed.out" in names else []) + [n for _, n in layers]


def _classes(ev, name: str, live: list[int]) -> list[list[int]]:
    """Ranks grouped by equal values (bitwise or noise), largest group first."""
    groups: list[list[int]] = []
    for r in live:
        for g in groups:
            if ev.same(name, r, g[0]):
                g.append(r)
                break
        else:
            groups.append([r])
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def run_checks(records: dict[int, RankRecord], settings: dict, liveness: Optional[dict] = None,
               references: Optional[dict[str, torch.Tensor]] = None, evidence=None) -> dict:
    world = settings["world_size"]
    dtype = dtype_from_str(settings.get("dtype", "float32"))
    ev = evidence or TensorEvidence(records, dtype)
    live = sorted(records)
    out: dict = {"points": [], "allreduce": {}, "slots": [], "findings": [], "ranks_missing": []}
    findings: list[Finding] = []
    roots: list[Finding] = []
    if not live:
        findings.append(Finding("rank-timeout", "the whole run", list(range(world)),
                                detail="no rank's capture is available", evidence={"all_ranks": True}))
        out["findings"] = [f.to_json() for f in findings]
        return out
    ref = live[0]

    # ---- liveness: missing, stalled and failed ranks -------------------------------------------
    missing = {int(r): v for r, v in (liveness or {}).get("missing", {}).items()}
    out["ranks_missing"] = sorted(missing)
    counts = {r: len(records[r].meta.get("allreduces", [])) for r in live}
    for r, info in sorted(missing.items()):
        stall = info.get("stall")
        if stall and all(counts[q] <= stall["collective"]["seq"] for q in live):
            c = stall["collective"]
            audit = stall.get("audit") or []
            where, extra_at = _extra_collective_place(audit, records[ref].meta.get("allreduces", []))
            if extra_at is not None and extra_at < len(audit) and extra_at != c["seq"]:
                a = audit[extra_at]
                text = (f"rank {r} issued an extra all-reduce #{extra_at} at {a['where']} ({a['module']}, shape "
                        f"{a['shape']}) that ranks {live} never issued; from there its collectives paired with "
                        f"the wrong ones and it blocked in #{c['seq']}, one more than the others' "
                        f"{max(counts.values())}")
            else:
                text = (f"rank {r} blocked in all-reduce #{c['seq']} ({c.get('module')}, shape {c.get('shape')}) "
                        f"that ranks {live} never issued (they issued {max(counts.values())})")
            roots.append(Finding("collective-mismatch", where or c.get("where", "?"), [r],
                                 detail=text + f"; rank {r} was stopped",
                                 evidence={"stall": stall, "counts": counts}))
        else:
            hb = info.get("heartbeat") or {}
            doing = f"{hb.get('phase', 'starting')}{': ' + hb['where'] if hb.get('where') else ''}"
            if hb.get("collective"):
                doing += f", in all-reduce #{hb['collective']['seq']} ({hb['collective'].get('module')})"
            if hb.get("done") is not None:     # NCCL: what its GPU completed (CUDA events)
                doing += (f"; its GPU had completed all-reduce #{hb['done']}" if hb["done"] >= 0
                          else "; its GPU had completed no all-reduce")
            fr = _flight_text((liveness or {}).get("flight_recorder"))
            if fr:
                doing += f"; NCCL flight recorder: {fr}"
            state = info.get("state", "died or hung")
            roots.append(Finding(
                "rank-timeout", hb.get("phase") or "startup", [r],
                detail=(f"rank {r} {state}; its last heartbeat said: {doing}"
                        + (f", {info['silent_s']:.1f} s before the others gave up" if "silent_s" in info else "")
                        + "; the others stopped within the timeout"),
                evidence={"heartbeat": hb}))
    errors = {r: records[r].meta.get("error") for r in live if records[r].meta.get("status") == "error"}
    if errors and not roots:
        for r, e in sorted(errors.items()):
            roots.append(Finding("rank-error", "probe", [r], detail=str(e)[:300]))
    complete = not missing and not errors

    # ---- collective sequences ------------------------------------------------------------------
    seqs = {r: [(a["where"], tuple(a["shape"]), a["group_size"]) for a in records[r].meta.get("allreduces", [])]
            for r in live}
    if complete and len({tuple(s) for s in seqs.values()}) > 1:
        common = Counter(tuple(s) for s in seqs.values()).most_common(1)[0][0]
        odd = [r for r in live if tuple(seqs[r]) != common]
        r0 = odd[0]
        i = next((i for i, (a, b) in enumerate(zip(seqs[r0], common)) if a != b), min(len(seqs[r0]), len(common)))
        mine = seqs[r0][i] if i < len(seqs[r0]) else None
        theirs = common[i] if i < len(common) else None
        roots.append(Finding("collective-mismatch", (mine or theirs)[0], odd,
                             detail=f"all-reduce #{i}: rank {r0} issued {_ar_text(mine)}, the others "
                                    f"{_ar_text(theirs)} ({len(seqs[r0])} vs {len(common)} all-reduces)",
                             evidence={"index": i, "counts": {r: len(s) for r, s in seqs.items()}}))

    # ---- cross-rank on every capture point -----------------------------------------------------
    names = []
    for r in live:
        for p in records[r].meta.get("points", []):
            if p["name"] not in names:
                names.append(p["name"])
    if "aux.packed" not in names and any("aux.packed" in records[r].tensors or records[r].meta.get("aux")
                                         for r in live):
        names.append("aux.packed")
    point_stats: dict[str, dict[int, dict]] = {}
    for name in names:
        per = ev.point_stats(name, live, ref)
        if not per:
            continue
        point_stats[name] = per
        levels = [s["level"] for s in per.values()]
        worst = max(levels, key=LEVELS.index)
        out["points"].append({"name": name, "layer": point_layer(name), "level": worst,
                              "reference_rank": ref, "per_rank": {str(r): s for r, s in per.items()}})

    # ---- all-reduce completeness ---------------------------------------------------------------
    ar = _allreduce_audit(ev, records, live, world) if complete else {"checked": 0, "records": []}
    ar["count_per_rank"] = {str(r): c for r, c in counts.items()}
    out["allreduce"] = ar

    # ---- root cause on the residual stream -----------------------------------------------------
    if complete and not roots:
        roots += _diagnose_stream(ev, records, live, world, point_stats, ar, dtype, references)

    # ---- slots: what the draft model receives --------------------------------------------------
    slot_findings, out["slots"] = _slots(ev, records, live, settings) if complete else ([], [])
    if complete and not roots and "aux.packed" in point_stats and not slot_findings:
        bad = [r for r, s in point_stats["aux.packed"].items() if s["level"] in ("material", "shape")]
        if bad:
            roots.append(Finding("rank-divergence", "aux.packed", bad,
                                 detail=f"the packed aux hidden state differs on ranks {bad} while the "
                                        f"residual streams agree"))

    # ---- consequences and noise ----------------------------------------------------------------
    material = [n for n in names if any(s["level"] in ("material", "shape") for s in point_stats.get(n, {}).values())]
    if roots:
        roots[0].consequences = [f"{n}: ranks {[r for r, s in point_stats[n].items() if s['level'] in ('material', 'shape')]} "
                                 f"differ" for n in material if n != roots[0].where][:64]
    from .capture import point_set_mismatches
    set_findings = [Finding("capture-mismatch", m["point"], m["ranks"], detail=m["detail"])
                    for m in point_set_mismatches({r: records[r].meta for r in live})] if complete else []
    findings += roots + slot_findings + set_findings
    explained = {f.where for f in findings} | ({"aux.packed"} if slot_findings else set())
    noisy = [n for n in names if n not in explained
             and any(s["level"] == "noise" for s in point_stats.get(n, {}).values())]
    if noisy:
        worst_ulp = max([s.get("ulp_max", 0) for n in noisy for s in point_stats[n].values()] + [0])
        findings.append(Finding("rounding-noise", ", ".join(noisy[:6]) + (" …" if len(noisy) > 6 else "") or "all-reduce",
                                sorted({r for n in noisy for r, s in point_stats[n].items() if s["level"] == "noise"}),
                                severity=INFO,
                                detail=f"{len(noisy)} capture points differ by "
                                       f"rounding only (max {worst_ulp:.1f} ULP at the element's scale): not a failure"))
    if references and complete and not any(f.severity == FAILURE for f in findings):
        findings += _reference_check(records[ref], references, dtype)
    out["findings"] = [f.to_json() for f in findings]
    return out


def _ar_text(a) -> str:
    if a is None:
        return "nothing"
    return f"one at {a[0]} of shape {list(a[1])} over {a[2]} ranks"


def _flight_text(fr: Optional[dict]) -> str:
    """Which collective sequence number each rank's NCCL reached, from the flight recorders."""
    parts = []
    for r, v in sorted((fr or {}).items(), key=lambda kv: int(kv[0])):
        for g in (v.get("groups") or {}).values():
            t = f"rank {r} completed seq {g['last_completed']}"
            if g.get("first_open"):
                o = g["first_open"]
                t += f", seq {o['seq']} {o.get('op') or ''} {o.get('state') or ''}".rstrip()
            parts.append(t)
            break      # the default group (the model's) first
    return "; ".join(parts)


def _extra_collective_place(audit, ref_audit):
    """Where a stalled rank's sequence first departs from the others' (the extra collective)."""
    if not audit:
        return None, None
    for i, a in enumerate(audit):
        if i >= len(ref_audit) or (a["where"], a["shape"]) != (ref_audit[i]["where"], ref_audit[i]["shape"]):
            return a["where"], i
    return None, None


def _allreduce_audit(ev, records, live, world) -> dict:
    n = min(len(records[r].meta.get("allreduces", [])) for r in live)
    res = {"checked": 0, "complete": 0, "noise": 0, "incomplete": 0, "records": []}
    for i in range(n):
        metas = [records[r].meta["allreduces"][i] for r in live]
        m = metas[0]
        entry = {k: m[k] for k in ("seq", "where", "module", "source", "shape", "dtype", "group_size", "op")}
        per = ev.allreduce(i, live, m) if m["op"] == "SUM" and len(live) == world else None
        if per is None:
            entry["level"] = "unchecked"
            res["records"].append(entry)
            continue
        levels = {p["level"] for p in per.values()}
        entry["level"] = "incomplete" if "material" in levels else ("noise" if "noise" in levels else "exact")
        entry["per_rank"] = per
        res["checked"] += 1
        res["complete" if entry["level"] != "incomplete" else "incomplete"] += 1
        res["noise"] += entry["level"] == "noise"
        res["records"].append(entry)
    return res


def _diagnose_stream(ev, records, live, world, point_stats, ar, dtype, references) -> list[Finding]:
    order = stream_order(point_stats)
    bad = lambda n: [r for r, s in point_stats[n].items() if s["level"] in ("material", "shape")]  # noqa: E731
    # non-finite first: NaN spreads through every later reduce
    for n in order + [x for x in point_stats if x not in order and not x.startswith("aux")]:
        nf = [r for r, s in point_stats[n].items() if s.get("nan") or s.get("inf")]
        if nf:
            s = point_stats[n][nf[0]]
            return [Finding("non-finite", n, nf, detail=f"{s['nan']} NaN and {s['inf']} Inf values on "
                                                          f"rank{'s' if len(nf) > 1 else ''} {', '.join(map(str, nf))}")]
    # replicated parameters that differ across ranks (stale or wrong copy)
    pf = _param_divergence(records, live)
    first = next((n for n in order if bad(n)), None)
    if first is None:
        return pf
    layer = point_layer(first)
    all_r = {"all_ranks": True}
    if first == "embed.out":
        if not any(a["where"] == "embed" for r in live for a in records[r].meta.get("allreduces", [])):
            rows = torch.stack([ev.rows_nonzero("embed.out", r) for r in live])
            single = float((rows.sum(0) == 1).float().mean())
            evid = {"rows_nonzero_on_one_rank": single, **all_r}
            if references and "embed.out" in references:
                evid["sum_over_ranks_vs_reference"] = ev.sum_vs("embed.out", live, references["embed.out"])
            return [Finding("partial-allreduce", "embedding (" + _embed_module(records, live) + ")", list(live),
                            detail=f"embedding output is each rank's partial sum: no all-reduce ran in the "
                                   f"embedding; {single:.0%} of token rows are non-zero on exactly one rank"
                                   + (f"; the sum over ranks matches the reference ({evid['sum_over_ranks_vs_reference']})"
                                      if "sum_over_ranks_vs_reference" in evid else ""),
                            evidence=evid)]
    # an all-reduce over a sub-group in this layer
    sub = [a for a in ar.get("records", []) if a.get("group_size", world) < world
           and (a["where"] == f"layer.{layer}" or layer == -1 and a["where"] == "embed")]
    if sub:
        groups = _classes(ev, first, [r for r in live if r in point_stats[first]])
        a = sub[0]
        return [Finding("subgroup-allreduce", f"layer {layer} ({a.get('source') or a['module']})", list(live),
                        detail=f"all-reduce #{a['seq']} summed over {a['group_size']} of {world} ranks; "
                               f"ranks agree within {groups} and differ across them",
                        evidence={"groups": groups, **all_r})]
    # a row-parallel output in this layer that no all-reduce consumed
    unreduced = [u for r in live for u in records[r].meta.get("unreduced_rows", []) if u["layer"] == layer]
    if unreduced:
        mod = unreduced[0]["module"]
        ranks = sorted({r for r in live for u in records[r].meta.get("unreduced_rows", []) if u["module"] == mod})
        n_here = Counter(a["where"] for a in records[live[0]].meta.get("allreduces", []))
        typical = Counter(n for w, n in n_here.items() if w.startswith("layer.")).most_common(1)
        others = f" (other layers: {typical[0][0]})" if typical else ""
        return [Finding("partial-allreduce", f"layer {layer} ({mod})", ranks,
                        detail=f"{mod} output was never all-reduced: {n_here.get(f'layer.{layer}', 0)} all-reduce(s) "
                               f"ran in layer {layer}{others}; from here on the stream holds each rank's partial sum",
                        evidence={"unreduced": unreduced, **({"all_ranks": True} if len(ranks) == world else {})})]
    if pf:
        return pf
    groups = _classes(ev, first, [r for r in live if r in point_stats[first]])
    odd = sorted(r for g in groups[1:] for r in g) if len(groups) > 1 else bad(first)
    s = point_stats[first][odd[0]] if odd and odd[0] in point_stats[first] else {}
    return [Finding("rank-divergence", first, odd,
                    detail=f"{point_label(first)} differs materially on rank{'s' if len(odd) > 1 else ''} "
                           f"{', '.join(map(str, odd))} (max abs diff {s.get('max_abs', 0):.3g}, rel diff "
                           f"{s.get('rel_diff', 0):.3g}, first token {s.get('first_token')})",
                    evidence={"groups": groups})]


def _embed_module(records, live) -> str:
    return records[live[0]].meta.get("embed_module") or "VocabParallelEmbedding"


def _param_divergence(records, live) -> list[Finding]:
    params = {r: records[r].meta.get("params", {}) for r in live}
    found = []
    for name in params[live[0]]:
        hashes = {r: params[r].get(name, {}).get("hash") for r in live}
        if len(set(hashes.values())) > 1:
            common, n_common = Counter(hashes.values()).most_common(1)[0]
            known = params[live[0]][name].get("replicated", True)
            if not known and n_common * 2 <= len(live):
                continue   # maybe a shard: only a strict majority of equal copies proves it replicated
            odd = [r for r, h in hashes.items() if h != common]
            if len(odd) * 2 == len(live):      # a tie: call the ranks other than the lowest one's group odd
                odd = [r for r in live if hashes[r] != hashes[live[0]]]
            layer = params[live[0]][name].get("layer")
            found.append(Finding("rank-divergence", f"{'layer ' + str(layer) + ' ' if layer is not None else ''}"
                                 f"parameter {name}", odd,
                                 detail=f"replicated parameter {name} differs on rank{'s' if len(odd) > 1 else ''} "
                                        f"{', '.join(map(str, odd))} (a stale or wrong copy: every rank must hold "
                                        f"the same values)"))
            break
    return found


def _reference_check(rec: RankRecord, references, dtype) -> list[Finding]:
    for name in stream_order(references):
        if name in rec.tensors:
            c = compare(rec.tensors[name], references[name].to(rec.tensors[name]), dtype=dtype)
            if c["level"] in ("material", "shape"):
                return [Finding("reference-mismatch", name, [rec.rank], severity=WARNING,
                                detail=f"{point_label(name)} differs from the unsharded tp=1 reference "
                                       f"(rel diff {c.get('rel_diff', 0):.3g}) while ranks agree",
                                evidence={"all_ranks": True})]
    return []


# ---- slots -------------------------------------------------------------------------------------
def _slots(ev, records, live, settings) -> tuple[list[Finding], list[dict]]:
    ids: list[int] = settings.get("layer_ids") or []
    hidden, world, L = settings["hidden"], settings["world_size"], settings.get("num_layers")
    if settings.get("expected_points") is not None:
        # arch-aware (SGLang's rules, tpprobe.layer_ids.expected_slots): one point per slot in slot
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
    for r in live:
        rec = records[r]
        width = ev.packed_width(r)
        aux_meta = rec.meta.get("aux", {})
        if width is None:
            verdicts[r] = ("missing-capture", "aux.packed", "the model produced no packed aux hidden state "
                           f"for ids {ids}")
            continue
        if aux_meta.get("dtype") and aux_meta["dtype"] != settings.get("dtype"):
            verdicts[r] = ("dtype-mismatch", "aux.packed", f"packed aux is {aux_meta['dtype']} where the "
                           f"model runs {settings.get('dtype')}")
            continue
        if aux_meta.get("contiguous") is False:
            verdicts[r] = ("layout-mismatch", "aux.packed", "packed aux is a non-contiguous view "
                           f"(strides {aux_meta.get('stride')})")
            continue
        if world > 1 and width == n_slots * hidden // world and width != n_slots * hidden:
            verdicts[r] = ("tp-sliced", "aux.packed", f"packed aux width is {width} = {n_slots} × "
                           f"{hidden // world} (hidden {hidden} / tp {world}): each slot is a TP slice")
            continue
        if width % hidden:
            verdicts[r] = ("layout-mismatch", "aux.packed", f"packed aux width {width} is not a multiple "
                           f"of hidden {hidden}")
            continue
        match = ev.slot_match(r, hidden)
        if match is None:
            continue
        if r == live[0]:
            rows_out = [{"slot": i, "id": ids[i] if i < len(ids) else None,
                         "expected": expected[i] if i < len(expected) else None, "matched": m,
                         "ok": i < len(expected) and m == expected[i]} for i, m in enumerate(match)]
        verdicts[r] = _slot_verdict(ids, expected, match, L)
    # group identical verdicts
    by: dict[tuple, list[int]] = {}
    for r, v in verdicts.items():
        if v is not None:
            by.setdefault(v, []).append(r)
    for (kind, where, detail), ranks in by.items():
        findings.append(Finding(kind, where, sorted(ranks), detail=detail,
                                evidence={"all_ranks": len(ranks) == world}))
    return findings, rows_out


def _pos(point: Optional[str]) -> Optional[float]:
    if point is None:
        return None
    if point == "layer.0.in_norm":
        return -0.5
    return float(point_layer(point)) if point_layer(point) is not None else None


def _slot_verdict(ids, expected, match, L):
    def lab(p):
        return point_label(p) if p else "no candidate"

    if len(match) < len(expected):
        have = set(match)
        lost = [i for i, e in zip(ids, expected) if e not in have]
        if lost and all(m in expected for m in match):
            why = []
            for i in lost:
                why.append(f"id {i} produced no capture" + (
                    f": it maps to layer {i + 1} = num_layers, past the last layer, and is silently dropped"
                    if L is not None and i + 1 >= L else ""))
            return ("missing-capture", f"aux slot for id {lost[0]}" if len(lost) == 1 else f"aux slots for ids {lost}",
                    "; ".join(why) + f" ({len(match)} of {len(expected)} slots present)")
    if match == expected:
        return None
    wrong = [i for i, (m, e) in enumerate(zip(match, expected)) if m != e]
    where = f"aux slot {wrong[0]}" if len(wrong) == 1 else f"aux slots {wrong}"
    text = "; ".join(f"slot {i} (id {ids[i] if i < len(ids) else '?'}) equals {lab(match[i])}, expected "
                     f"{lab(expected[i]) if i < len(expected) else 'nothing'}" for i in wrong)
    dup = [m for m, c in Counter(m for m in match if m).items() if c > 1]
    if dup:
        last = max(dup, key=lambda m: _pos(m) or -9)
        same = [i for i, m in enumerate(match) if m == last]
        return ("aliased-capture", f"aux slots {same}", f"slots {same} all hold {lab(last)}: captured without clone() "
                                          f"from a buffer that later layers overwrote")
    if any(expected[i] == "embed.out" and match[i] in ("layer.0.in_norm",) for i in wrong):
        i = next(i for i in wrong if expected[i] == "embed.out")
        return ("transformed-capture", f"aux slot {i}", f"slot {i} equals {lab(match[i])}, expected the raw "
                                                        f"embedding (the capture is taken after a transform)")
    deltas = {(_pos(match[i]) - _pos(expected[i])) if match[i] and _pos(match[i]) is not None else None for i in wrong}
    if len(deltas) == 1 and next(iter(deltas)) in (-1.0, 1.0):
        d = next(iter(deltas))
        return ("capture-offset", where, f"{text}: one layer {'early' if d < 0 else 'late'} "
                                         f"(the EAGLE-3 +1 was {'not applied' if d < 0 else 'applied twice'})")
    if set(match) == set(expected) and None not in match and \
            match == sorted(expected, key=lambda p: _pos(p) if _pos(p) is not None else 1e9):
        return ("slot-mismatch", where, f"the ids {ids} are not in layer order, but the model appends each "
                                        f"capture as its layer runs, so the slots follow layer order: {text}; "
                                        f"give the ids in layer order (and train the draft on that order)")
    if set(match) == set(expected):
        return ("slot-mismatch", where, f"slots are permuted: {text}")
    extra = [m for m in match if m not in expected]
    msg = f"{text}"
    if "embed.out" in expected and "embed.out" not in match:
        msg += f"; the embedding slot is missing and {lab(extra[-1]) if extra else 'another layer'} was captured"
    return ("slot-mismatch", where, msg)
