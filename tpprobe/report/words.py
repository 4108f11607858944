"""The sentences the probe's report says about a run: a cell's words, the audit, coverage, timings.

Kept apart from report/labels.py so the renderers compute nothing about the run: probe/report.py
and probe/page.py build sections from these, and the dumper's check (dumpdir/report.py) reads `cell_label`.
"""
from __future__ import annotations

from typing import Optional

from ..capture.points import is_layer_place, place_layer

HEALTHY_LINE = "HEALTHY: every capture point agrees across ranks and every all-reduce is complete"
NOT_CHECKED_ONE_RANK = "NOT CHECKED ACROSS RANKS (1 rank: no other rank to compare with, no all-reduce to check): "


def one_rank(report: dict) -> bool:
    """A run of one rank (tp 1): nothing in it was compared across ranks."""
    return (report.get("settings") or {}).get("world_size") == 1


def healthy_line(report: dict) -> str:
    """The verdict of a run with no finding, saying only what was checked: one rank has no peer
    to agree with and issues no all-reduce (a tp-1 run), so it is never HEALTHY: its line says
    that nothing was compared across ranks and what its single-rank checks found."""
    if not one_rank(report):
        kinds = {str(e.get("kind", "all_reduce")) for e in (report.get("allreduce") or {}).get("records", [])
                 if e.get("level") != "unchecked"}
        if kinds - {"all_reduce"}:   # reduce-scatters, all-gathers: each was checked by its own definition
            return ("HEALTHY: every capture point agrees across ranks and every collective returned what its "
                    "definition says")
        return HEALTHY_LINE
    slots = report.get("slots") or []
    held = (f"the {len(slots)} aux slots hold the points they should and " if slots and all(x.get("ok") for x in slots)
            else "")
    return NOT_CHECKED_ONE_RANK + held + "no value is NaN or Inf"


def healthy_level(report: dict) -> str:
    """The level of that line: `ok` (HEALTHY), `info` for one rank (nothing compared across ranks)."""
    return "info" if one_rank(report) else "ok"


def verdict_lines(report: dict) -> list[str]:
    lines = [f["line"] for f in report["findings"]]
    return lines or [healthy_line(report)]


def verdict_items(report: dict) -> list[dict]:
    fs = report.get("findings") or []
    if fs:
        return fs
    return [{"severity": healthy_level(report), "line": healthy_line(report)}]


def cell_label(s: Optional[dict]) -> str:
    """The text of one capture point × rank cell (terminal, HTML and Markdown use the same words)."""
    if not s:
        return "—"
    lv = s.get("level", "?")
    if lv in ("reference", "bitwise", "share"):
        label = {"reference": "ref", "bitwise": "bitwise", "share": "own share"}[lv]
    elif lv == "shape":
        label = f"shape {s.get('shape')}"
    elif s.get("max_abs") is None:      # judged on fingerprints: the norm-wise relative difference
        label = f"{lv} ~{s.get('rel_norm', 0):.2g} rel"
    elif not s["max_abs"] and (s.get("nan") or s.get("inf")):
        label = lv                      # the finite values agree: the NaN / Inf counts below are the difference
    else:                               # whole tensors: the max abs difference
        label = f"{lv} {s['max_abs']:.2g} abs"
    if s.get("nan") or s.get("inf"):
        label += f" nan={s.get('nan')} inf={s.get('inf')}"
    return label


def missing_allreduces(report: dict) -> list[dict]:
    """The all-reduces the diagnosis says never ran (they have no record: nothing was issued)."""
    out = []
    for f in report.get("findings", []):
        m = (f.get("evidence") or {}).get("missing_allreduce")
        if m and m not in out:
            out.append({**m, "ranks": f.get("ranks", [])})
    return out


def audit_text(ar: dict, missing: Optional[list] = None) -> str:
    """The all-reduce audit in one sentence, saying what the exchange mode can prove: full tensors
    show whether each output is exactly the sum of its inputs or within rounding of it; sketches
    (--exchange fingerprint) prove complete within rounding only, never bit-exact."""
    checked, complete, incomplete = ar.get("checked", 0), ar.get("complete", 0), ar.get("incomplete", 0)
    # the ops and collectives checked other than a plain sum, each by its own definition
    seen = [e for e in ar.get("records", []) if e.get("level") != "unchecked"]
    other = sorted({str(e.get("op")) if e.get("kind", "all_reduce") in ("all_reduce", "reduce_scatter")
                    else str(e.get("kind")).replace("_", "-") for e in seen} - {"SUM", "None"}
                   | ({"reduce-scatter"} if any(e.get("kind") == "reduce_scatter" for e in seen) else set()))
    own = f" (the {', '.join(other)} ones by their own definition)" if other else ""
    # collectives other than all-reduces (a reduce-scatter: its slice of the sum; an all-gather: the
    # concatenation) are counted by kind, so the line never calls them all-reduces
    kinds: dict = {}
    for e in seen:
        k = str(e.get("kind") or "all_reduce").replace("_", "-")
        kinds[k] = kinds.get(k, 0) + 1
    mixed = set(kinds) - {"all-reduce"}
    what = ("collectives checked (" + ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in kinds.items()) + ")"
            if mixed else "all-reduces checked")
    if ar.get("method") == "sketch":
        how = ("each output's sketch against the sum of its inputs' sketches" + own + " (--exchange fingerprint: "
               "proves complete within rounding, not bit-exact)")
        done = f"{complete} complete within rounding"
    else:
        noise = ar.get("noise", 0)
        how = "each output against the sum of its inputs over the ranks" + own + ", element by element"
        done = f"{complete} complete ({complete - noise} exactly {'their definition' if other else 'the sum'}, " \
               f"{noise} within rounding)"
    counts = ar.get("count_per_rank") or {}
    issued = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
    text = f"{checked} {what}, {how}: {done}, {incomplete} incomplete"
    if ar.get("unchecked"):      # counted, never passed silently: how many and why
        why = ar.get("unchecked_why") or {}
        text += f", {ar['unchecked']} unchecked" + (" (" + ", ".join(
            f"{n} × {w}{' (fingerprint mode)' if w.endswith('from sketches') else ''}" for w, n in why.items())
            + ")" if why else "")
    if issued:
        text += f"; issued per rank: {issued}"
    for m in missing or []:
        text += f"; never issued: the all-reduce of {m['module']} ({m['where']})"
    return text


def _ranks(rs) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def _layer_span(ks: list[int]) -> str:
    return f"layer {ks[0]}" if len(ks) == 1 else f"layers {ks[0]}–{ks[-1]}"


MAX_LAYER_GROUPS = 6


def reduces_text(cov: dict, world: int, missing=()) -> str:
    """Per layer, how many reduces each rank issued that the audit saw: runs of layers with the same
    counts share a line, e.g. "layers 0–2: 2 on each of ranks 0, 1, 3; layer 3: 1 on each of ranks 0, 1,
    3; layers 4–5: none; rank 2: no record" (rank 2 missing)."""
    places = cov.get("reduces_per_place") or {}
    per = {place_layer(w): v for w, v in places.items() if is_layer_place(w)}
    if not per:
        return "no reduce audited in any layer"
    missing = sorted(int(r) for r in missing)
    ranks = [r for r in range(max(world, 1)) if r not in missing] or sorted({int(r) for v in per.values() for r in v})

    def counts(v: dict) -> str:
        by: dict[int, list[int]] = {}
        for r in ranks:
            by.setdefault(int(v.get(str(r), 0)), []).append(r)
        if len(by) == 1:
            n = next(iter(by))
            if n == 0:
                return "none"
            if not missing:
                return f"{n} on every rank"
            return f"{n} on {_ranks(ranks)}" if len(ranks) == 1 else f"{n} on each of {_ranks(ranks)}"
        return ", ".join(f"{n} on {_ranks(rs)}" for n, rs in sorted(by.items(), reverse=True))

    layers = range(min(min(per), 0), max(max(per) + 1, cov.get("layers_found") or 0))
    groups: list[tuple[list[int], str]] = []
    for k in layers:
        c = counts(per.get(k, {}))
        if groups and groups[-1][1] == c and groups[-1][0][-1] == k - 1:
            groups[-1][0].append(k)
        else:
            groups.append(([k], c))
    text = "; ".join(f"{_layer_span(ks)}: {c}" for ks, c in groups[:MAX_LAYER_GROUPS])
    if len(groups) > MAX_LAYER_GROUPS:
        text += f"; … {len(groups) - MAX_LAYER_GROUPS} more runs of layers in report.json (coverage)"
    if missing:
        text += f"; {_ranks(missing)}: no record"
    return text


# findings that say the forward stopped on some rank: what coverage did not see is not "not found"
STOPPED_KINDS = ("rank-error", "rank-timeout", "internal-error", "collective-mismatch")


def coverage_parts(report: dict) -> list[tuple[str, str, bool]]:
    """What was hooked and audited (part of the verdict: checks/coverage.py), as (what, text, bad)
    rows: the embedding, the decoder layers, the reduces per layer and rank, the paths they took."""
    cov = report.get("coverage") or {}
    if not cov.get("known"):
        return []
    st = report.get("settings") or {}
    L = st.get("num_layers")
    found, ran = cov.get("layers_found"), cov.get("layers_ran")
    stopped = report.get("ranks_missing") or any(f.get("kind") in STOPPED_KINDS for f in report.get("findings", []))
    emb = (f"{cov['embed']} (found by {cov.get('embed_how')})", False) if cov.get("embed") else \
        ("not seen (the forward stopped before an embedding returned)", False) if stopped else ("NOT FOUND", True)
    hooked = f"{found} of {L} hooked" if L is not None else f"{found} hooked"
    if ran is not None and found and ran < found:
        hooked += f", {ran} ran"
    layers = (f"{hooked} ({cov.get('layer_how')}: {cov.get('layer_list') or '-'}, "
              f"{', '.join(cov.get('layer_classes') or [])})")
    red = reduces_text(cov, int(st.get("world_size") or 1), report.get("ranks_missing") or ())
    paths = ", ".join(f"{p} ×{n}" for p, n in (cov.get("paths") or {}).items()) or "none"
    rows = [("embedding", emb[0], emb[1]),
            ("decoder layers", layers,
             not found or (L is not None and found != L) or (ran is not None and ran < found)),
            ("reduces per layer and rank", red, red.startswith("no reduce")),
            ("through", paths, False)]
    unread = cov.get("unreadable_paths") or {}
    if unread:
        rows.append(("NOT READABLE", ", ".join(f"{p} ×{n}" for p, n in unread.items()), True))
    return rows


def coverage_text(report: dict) -> str:
    """The coverage in one line (the terminal's; Markdown's)."""
    return " · ".join(f"{what} {text}" if what != "reduces per layer and rank" else f"{what}: {text}"
                      for what, text, _ in coverage_parts(report))


def slot_values_differ(report: dict, row: dict) -> list[int]:
    """Ranks on which what a slot holds differs materially from the reference rank: a slot can hold the
    right layer and still carry wrong values (a partial sum, a stale weight)."""
    if row.get("differ") is not None:       # the slot's own values, compared across ranks by the checks
        return list(row["differ"])
    points = {p["name"]: p for p in report.get("points", [])}
    bad: set[int] = set()
    for name in (row.get("matched"), row.get("expected")):
        for r, s in ((points.get(name) or {}).get("per_rank") or {}).items():
            if s and s.get("level") in ("material", "shape"):
                bad.add(int(r))
    return sorted(bad)


def slot_holds(row: dict) -> str:
    """What a slot holds, in the slot table's words: a capture point, or none of them."""
    return str(row["matched"]) if row.get("matched") else "no stream"


def slot_fault_first(report: dict) -> bool:
    """Is the first failure about the aux slots? Then the slot table is the decisive one."""
    first = next((f for f in report.get("findings", []) if f["severity"] == "failure"), None)
    return bool(first) and (str(first["where"]).startswith("aux slot") or first["kind"] == "tp-sliced")


PHASES = (("build_s", "model build"), ("start_s", "every rank ready at"), ("forward_s", "forward"),
          ("exchange_s", "exchange"), ("check_s", "checks"), ("total_s", "total"))


def timing_text(report: dict) -> str:
    """The phases the run timed (rank 0's clock); an offline report shows the live run's, so labelled."""
    tm = report.get("timings") or {}
    parts = [f"{label} {tm[k]:.2f}s" for k, label in PHASES if k in tm]
    if not parts:
        return ""
    return ("time when captured: " if report.get("offline") else "time: ") + " · ".join(parts)
