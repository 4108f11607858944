"""The words every renderer uses for a cell and for the verdict (terminal, HTML, Markdown).

Renderers import this module, never each other.
"""
from __future__ import annotations

from typing import Optional

from ..capture.points import is_layer_place

HEALTHY_LINE = "HEALTHY: every capture point agrees across ranks and every all-reduce is complete"


def verdict_lines(report: dict) -> list[str]:
    lines = [f["line"] for f in report["findings"]]
    return lines or [HEALTHY_LINE]


def verdict_items(report: dict) -> list[dict]:
    fs = report.get("findings") or []
    if fs:
        return fs
    return [{"severity": "ok", "line": HEALTHY_LINE}]


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
    else:
        label = f"{lv} {s['max_abs']:.2g}"
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
    if ar.get("method") == "sketch":
        how = ("each output's sketch against the sum of its inputs' sketches (--exchange fingerprint: proves "
               "complete within rounding, not bit-exact)")
        done = f"{complete} complete within rounding"
    else:
        noise = ar.get("noise", 0)
        how = "each output against the sum of its inputs over the ranks, element by element"
        done = f"{complete} complete ({complete - noise} exactly the sum, {noise} within rounding)"
    counts = ar.get("count_per_rank") or {}
    issued = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
    text = f"{checked} all-reduces checked, {how}: {done}, {incomplete} incomplete"
    if issued:
        text += f"; issued per rank: {issued}"
    for m in missing or []:
        text += f"; never issued: the all-reduce of {m['module']} ({m['where']})"
    return text


def coverage_text(cov: dict, num_layers=None) -> str:
    """What was hooked and audited, in one line (part of the verdict: checks/coverage.py)."""
    if not cov or not cov.get("known"):
        return ""
    emb = f"embedding {cov['embed']} ({cov.get('embed_how')})" if cov.get("embed") else "embedding NOT FOUND"
    L = f"{cov.get('layers_found')} of {num_layers}" if num_layers is not None else str(cov.get("layers_found"))
    layers = f"layers {L} ({cov.get('layer_how')}: {cov.get('layer_list') or '-'}, {', '.join(cov.get('layer_classes') or [])})"
    places = cov.get("reduces_per_place") or {}
    per = sorted({tuple(sorted(v.items())) for w, v in places.items() if is_layer_place(w)})
    red = ("reduces per layer and rank: " + "; ".join(", ".join(f"rank {r}: {n}" for r, n in p) for p in per[:3])
           if per else "no reduce audited in any layer")
    paths = ", ".join(f"{p} ×{n}" for p, n in (cov.get("paths") or {}).items()) or "none"
    unread = cov.get("unreadable_paths") or {}
    text = f"{emb} · {layers} · {red} · through {paths}"
    if unread:
        text += " · NOT READABLE: " + ", ".join(f"{p} ×{n}" for p, n in unread.items())
    return text


def slot_values_differ(report: dict, row: dict) -> list[int]:
    """Ranks on which what a slot holds differs materially from the reference rank: a slot can hold the
    right layer and still carry wrong values (a partial sum, a stale weight)."""
    points = {p["name"]: p for p in report.get("points", [])}
    bad: set[int] = set()
    for name in (row.get("matched"), row.get("expected")):
        for r, s in ((points.get(name) or {}).get("per_rank") or {}).items():
            if s and s.get("level") in ("material", "shape"):
                bad.add(int(r))
    return sorted(bad)


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
