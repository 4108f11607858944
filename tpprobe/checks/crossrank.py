"""Cross-rank: every capture point of every rank against the reference rank, and the rounding-noise
summary for points that differ by rounding only."""
from __future__ import annotations

from .evidence import LEVELS
from .findings import INFO, Finding
from ..capture.points import AUX_PACKED, point_layer


def point_names(records: dict, live: list[int]) -> list[str]:
    """Every capture point any live rank recorded, in first-seen order (plus the packed aux)."""
    names = []
    for r in live:
        for p in records[r].meta.points:
            if p.name not in names:
                names.append(p.name)
    if AUX_PACKED not in names and any(AUX_PACKED in records[r].tensors or records[r].meta.aux for r in live):
        names.append(AUX_PACKED)
    return names


def cross_rank(ev, names: list[str], live: list[int], ref: int) -> tuple[dict, list[dict]]:
    """(per point, per rank stats; the report's rows) for every point the evidence can judge."""
    point_stats: dict[str, dict[int, dict]] = {}
    rows = []
    for name in names:
        per = ev.point_stats(name, live, ref)
        if not per:
            continue
        point_stats[name] = per
        levels = [s["level"] for s in per.values()]
        worst = max(levels, key=LEVELS.index)
        rows.append({"name": name, "layer": point_layer(name), "level": worst,
                     "reference_rank": ref, "per_rank": {str(r): s for r, s in per.items()}})
    return point_stats, rows


def rounding_noise(names: list[str], point_stats: dict, explained: set) -> list[Finding]:
    noisy = [n for n in names if n not in explained
             and any(s["level"] == "noise" for s in point_stats.get(n, {}).values())]
    if not noisy:
        return []
    # the worst of the noise itself: a point noisy on one rank may be material on another (named elsewhere)
    noise = [s for n in noisy for s in point_stats[n].values() if s["level"] == "noise"]
    worst_ulp = max([s.get("ulp_max") or 0 for s in noise] + [0])
    worst_rel = max([s.get("rel_norm") or 0 for s in noise] + [0])
    return [Finding("rounding-noise", ", ".join(noisy[:6]) + (" …" if len(noisy) > 6 else "") or "all-reduce",
                    sorted({r for n in noisy for r, s in point_stats[n].items() if s["level"] == "noise"}),
                    severity=INFO,
                    detail=f"{len(noisy)} capture points differ by "
                           f"rounding only (worst element {worst_ulp:.1f} ULP, relative error {worst_rel:.2g}, "
                           f"within core/noise.py's bounds): not a failure")]


def classes(ev, name: str, live: list[int]) -> list[list[int]]:
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
