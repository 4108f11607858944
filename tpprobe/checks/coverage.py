"""Coverage is part of the verdict: what the probe hooked and audited on every rank.

A run is HEALTHY only when the probe saw the model: the embedding (its module path), all L decoder
layers, and at tp > 1 at least one audited reduce, every one of which it could read. Otherwise a
`coverage` finding says what is missing and what to pass (--embed, --layer-list). Reduces that
came through a door the audit can count but not read (a custom all-reduce op, the list forms of
c10d collectives) are named with their path: counted per layer, never checked silently.
"""
from __future__ import annotations

from collections import Counter

from ..capture.points import is_layer_place, point_label, point_layer
from ..capture.schema import REDUCE_KINDS, Coverage
from .findings import WARNING, Finding


def summary(records, live) -> dict:
    """The coverage table of the report: rank 0's view, plus the per-rank reduce counts by place."""
    base = next((records[r].meta.coverage for r in live if records[r].meta.coverage), None)
    if base is None:       # an older capture: what its metadata says
        m = records[live[0]].meta
        return {"embed": m.embed_module, "layers_found": m.layers_hooked, "known": False}
    per_place: dict = {}
    paths: Counter = Counter()
    for r in live:
        for a in records[r].meta.collectives:
            if a.kind in REDUCE_KINDS:
                per_place.setdefault(a.where, {}).setdefault(str(r), 0)
                per_place[a.where][str(r)] += 1
            if r == live[0]:
                paths[a.path or "torch.distributed.all_reduce"] += 1
    return {**{k: getattr(base, k) for k in ("embed", "embed_how", "layer_list", "layer_how", "layers_found",
                                             "layers_ran", "layer_classes", "audit")},
            "reduces_per_place": per_place, "paths": dict(paths),
            "unreadable_paths": base.unreadable_paths, "known": True}


def coverage_findings(records, live, settings, cov: dict) -> list[Finding]:
    if not cov.get("known"):
        return []
    world, L = settings["world_size"], settings.get("num_layers")
    out = []
    all_r = {"all_ranks": True}
    if not cov.get("embed"):
        out.append(Finding("coverage", "embedding", list(live), detail=(
            "no embedding found: no module outside the decoder layers took the input ids and returned "
            "[tokens, hidden]; name it with --embed (module path, e.g. model.embed_tokens, or class name) "
            "or ProbeTarget(embed=...)"), evidence=all_r))
    found = cov.get("layers_found") or 0
    if not found:
        out.append(Finding("coverage", "decoder layers", list(live), detail=(
            "no decoder layers found (the model has no nn.ModuleList); name them with --layer-list "
            "(module path, e.g. model.layers, or a class-name glob) or ProbeTarget(layer_list=...)"), evidence=all_r))
    elif L is not None and found != L:
        out.append(Finding("coverage", f"decoder layers ({cov.get('layer_list') or cov.get('layer_how')})", list(live),
                           detail=(f"{found} of the model's {L} layers hooked ({cov.get('layer_how')}: "
                                   f"{cov.get('layer_list')}, {', '.join(cov.get('layer_classes') or [])}); "
                                   f"name the right list with --layer-list"), evidence=all_r))
    elif (cov.get("layers_ran") or 0) < found:
        out.append(Finding("coverage", f"decoder layers ({cov.get('layer_list')})", list(live),
                           detail=f"only {cov.get('layers_ran')} of {found} hooked layers ran in the forward",
                           evidence=all_r))
    places = cov.get("reduces_per_place", {})
    n_reduce = sum(sum(v.values()) for v in places.values())
    n_layer = sum(sum(v.values()) for w, v in places.items() if is_layer_place(w))
    if world > 1 and cov.get("audit", True) and found and n_layer == 0:
        seen = f"{n_reduce} outside them" if n_reduce else "none anywhere"
        out.append(Finding("coverage", "collective audit", list(live), detail=(
            f"tp={world} but no reduce was audited in any decoder layer ({seen}): the model reduces through "
            f"a path the audit cannot see (point-to-point sends, pynccl, a custom all-reduce, symmetric "
            f"memory: record it with Tap.collective), or its layers are not tensor-parallel; no layer's "
            f"reduce can be called complete"), evidence=all_r))
    unread = cov.get("unreadable_paths") or {}
    if unread:
        text = ", ".join(f"{n} × {p}" for p, n in unread.items())
        out.append(Finding("coverage", "collective audit", list(live), severity=WARNING, detail=(
            f"reduces counted but not readable, so not checked for completeness: {text} (they still count "
            f"per layer: a missing one is named at its layer)"), evidence=all_r))
    out += unreadable_findings(records, live) + partial_placement_findings(records, live)
    return out


def partial_placement_findings(records, live) -> list[Finding]:
    """A capture point that is a DTensor placed Partial still owes its reduce where it was read:
    DTensor says so itself (capture/hooks/ records each DTensor point's placements, and those of
    each row-parallel module's DTensor output). Named at its place: the layer and the module in it
    whose output was placed Partial (the layer itself when no such module was seen)."""
    owed: dict = {}
    for r in live:
        for name, pl in (records[r].meta.coverage.placements if records[r].meta.coverage else {}).items():
            if any(p.startswith("Partial") for p in pl):
                owed.setdefault(name, ([], pl))[0].append(r)
    out = []
    for name, (ranks, pl) in owed.items():
        where, k, module = _owed_place(records, ranks, name)
        by = f" (the output of {module}, placed Partial)" if module else ""
        out.append(Finding("partial-allreduce", where, ranks, detail=(
            f"{point_label(name)} is a DTensor placed {', '.join(pl)} on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}{by}: each rank holds a partial sum; it owes a reduce (a redistribute "
            f"to Replicate) that had not run where it was captured"),
            evidence={"placements": list(pl), "point": name, "layer": k, "module": module,
                      "all_ranks": sorted(ranks) == sorted(live)}))
    return out


def _owed_place(records, ranks, name: str) -> tuple:
    """(where, layer, module) of a point placed Partial: "layer K (MODULE)", MODULE the first module of
    that layer whose DTensor output was placed Partial, else the layer's own module."""
    k = point_layer(name)
    cov = records[ranks[0]].meta.coverage or Coverage()
    if k == -1 and cov.embed:
        return f"embedding ({cov.embed})", k, cov.embed
    if k is None or k < 0:
        return name, k, None
    names = cov.layer_names
    layer = names[k] if k < len(names) else None
    rows = cov.row_placements
    module = next((m for m, pl in rows.items() if layer and m.startswith(layer + ".")
                   and any(p.startswith("Partial") for p in pl)), None)
    return f"layer {k} ({module or layer or name})", k, module


def adopt_owed_placements(roots: list[Finding], cov_findings: list[Finding]) -> None:
    """A placement that owes a reduce is the root cause at its layer: where the stream's diagnosis
    found that layer's reduce missing, the placement's finding takes its place in `roots` (the stream's
    finding and its consequences listed under it) and leaves the coverage findings: one finding."""
    for p in [f for f in cov_findings if f.kind == "partial-allreduce" and "placements" in f.evidence]:
        k = p.evidence.get("layer")
        head = "embedding (" if k == -1 else f"layer {k} ("
        i = next((i for i, r in enumerate(roots) if k is not None and r.kind == "partial-allreduce"
                  and r.where.startswith(head)), None)
        if i is None:
            continue
        r = roots[i]
        p.ranks = sorted(set(p.ranks) | set(r.ranks))
        p.evidence["all_ranks"] = bool(p.evidence.get("all_ranks") or r.evidence.get("all_ranks"))
        p.evidence["stream"] = {"where": r.where, "missing_allreduce": r.evidence.get("missing_allreduce")}
        p.consequences = [f"{r.where}: {r.detail}"] + r.consequences
        roots[i] = p
        cov_findings.remove(p)


def unreadable_findings(records, live) -> list[Finding]:
    """A parameter or capture point tpprobe could not read on some rank (a tensor subclass without
    storage, a meta tensor): kept in the rank's record with the reason, named here, never compared."""
    what: dict = {}
    for r in live:
        meta = records[r].meta
        for name, e in meta.params.items():
            if e.hash is None and e.unreadable:
                what.setdefault(("parameter", name, e.unreadable), []).append(r)
        for name, why in (meta.coverage.unreadable_points if meta.coverage else {}).items():
            what.setdefault(("capture point", name, why), []).append(r)
    if not what:
        return []
    ranks = sorted({r for rs in what.values() for r in rs})
    text = "; ".join(f"{kind} {name} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} ({why})"
                     for (kind, name, why), rs in list(what.items())[:8])
    more = f"; and {len(what) - 8} more" if len(what) > 8 else ""
    return [Finding("coverage", "unreadable tensors", ranks, severity=WARNING, detail=(
        f"tpprobe could not read {len(what)} tensor(s), so they are not compared across ranks: {text}{more}"),
        evidence={"unreadable": [{"kind": k, "name": n, "why": w, "ranks": rs} for (k, n, w), rs in what.items()]})]
