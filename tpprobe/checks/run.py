"""The checks, in order: from what every rank captured to a short list of findings.

`run_checks(records, settings, liveness, references)` is the one entry point, used online (rank 0
after the exchange) and offline (`tpprobe report DIR`). It measures, then diagnoses:

  measure   cross-rank: every capture point of every rank against the reference rank
            allreduce-complete: every audited all-reduce output against Σ_ranks of its inputs
            layout: width, dtype, contiguity, finite values of the packed aux tensor and slots
            slots: which candidate (embedding, a layer's stream, layer 0's input norm) each slot equals
  diagnose  the root cause in model order; what follows from it is listed under it as
            consequences, never as separate failures.

Each family lives in its own module (liveness, collectives, crossrank, allreduce, stream, slots,
layout, params, reference); this one only runs them in order.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.capture_dir import LoadedRank, point_set_mismatches
from ..capture.points import AUX_PACKED
from .allreduce import allreduce_audit
from .collectives import sequence_mismatch
from .coverage import adopt_owed_placements, coverage_findings, summary as coverage_summary
from .crossrank import cross_rank, point_names, rounding_noise
from .draft import draft_findings
from .evidence import TensorEvidence
from .findings import FAILURE, WARNING, Finding
from .liveness import missing_rank_findings, rank_error_findings
from ..core.noise import dtype_from_str
from .reduces import first_divergence, incomplete_findings, incomplete_records, point_key, reduce_key
from .reference import reference_check
from .slots import check_slots
from .stream import diagnose_stream, silent_missing_reduce

# what to do about a collective the audit could not check, by reason (checks/allreduce.py's words)
_UNCHECKED_HINT = {
    "op": "--exchange full checks MAX, MIN and PRODUCT element by element",
    "tensors not kept": "its tensors were over the byte budget: raise --max-bytes to check it",
    "all-to-all split sizes not readable from the sketches": "--exchange full checks an uneven all-to-all",
    "non-finite values (a sketch cannot sum them)": "--exchange full judges its finite elements",
}


def run_checks(records: dict[int, LoadedRank], settings: dict, liveness: Optional[dict] = None,
               references: Optional[dict[str, torch.Tensor]] = None, evidence=None, offset_rule: bool = True) -> dict:
    """`offset_rule`: the engine's ids capture the output of layer k (SGLang's +1, the built-in model's); False
    for ids as written (vLLM's): the caller asks its engine (tpprobe.engines.registry.recorded)."""
    world = settings["world_size"]
    dtype = dtype_from_str(settings.get("dtype", "float32"))
    ev = evidence or TensorEvidence(records, dtype)
    live = sorted(records)
    out: dict = {"points": [], "allreduce": {}, "slots": [], "findings": [], "ranks_missing": [], "coverage": {}}
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
    counts = {r: len(records[r].meta.collectives) for r in live}
    roots += missing_rank_findings(missing, records, live, counts, (liveness or {}).get("flight_recorder"))
    errors = {r: records[r].meta.error for r in live if records[r].meta.status == "error"}
    if errors:
        places = {r: records[r].meta.coverage.raised_in if records[r].meta.coverage else None for r in errors}
        raised = rank_error_findings(errors, roots, places)
        for f in raised:             # one error in one module on every rank: said once, for all ranks
            f.evidence["all_ranks"] = f.evidence.get("all_ranks") or len(f.ranks) == world
        roots += raised
    complete = not missing and not errors

    # ---- collective sequences ------------------------------------------------------------------
    if complete:
        roots += sequence_mismatch(records, live)

    # ---- cross-rank on every capture point -----------------------------------------------------
    names = point_names(records, live)
    point_stats, out["points"] = cross_rank(ev, names, live, ref)

    # ---- all-reduce completeness ---------------------------------------------------------------
    ar = allreduce_audit(ev, records, live, world) if complete else {"checked": 0, "records": []}
    ar["count_per_rank"] = {str(r): c for r, c in counts.items()}
    out["allreduce"] = ar

    # ---- a reduce that ran and returned the wrong value (its own measurement) --------------------
    wrong = incomplete_findings(ar, records, live, world) if complete else []

    # ---- root cause on the residual stream -----------------------------------------------------
    if complete and not roots:
        first = first_divergence(point_stats)
        inc = incomplete_records(ar)
        if inc and (first is None or reduce_key(inc[0]) < point_key(first)):
            roots += wrong          # first in model order: what diverges later follows from it
            wrong = []
        else:
            roots += diagnose_stream(ev, records, live, world, point_stats, ar, dtype, references)
            if not roots:
                roots += silent_missing_reduce(records, live, world)

    # ---- slots: what the draft model receives --------------------------------------------------
    slot_findings, out["slots"] = check_slots(ev, records, live, settings, offset_rule) if complete else ([], [])
    basis_findings = draft_findings(settings, slot_findings, out["slots"], live) if complete else []
    if complete and not roots and AUX_PACKED in point_stats and not slot_findings:
        bad = [r for r, s in point_stats[AUX_PACKED].items() if s["level"] in ("material", "shape")]
        if bad:
            roots.append(Finding("rank-divergence", AUX_PACKED, bad,
                                 detail=f"the packed aux hidden state differs on ranks {bad} while the "
                                        f"residual streams agree",
                                 evidence={"explain": "the ranks packed different aux hidden states from residual "
                                                      "streams that agree: the packing or the capture runs a "
                                                      "rank-dependent path (no weight takes part in packing)"}))

    # ---- consequences and noise ----------------------------------------------------------------
    material = [n for n in names if any(s["level"] in ("material", "shape") for s in point_stats.get(n, {}).values())]
    if roots:
        follows = []
        if roots[0].kind == "non-finite":
            # NaN spreads through the reduces to every rank: later points that hold it agree across ranks,
            # so they are named by what they hold, not by a difference
            for n in names:
                nf = {r: s for r, s in point_stats.get(n, {}).items() if s.get("nan") or s.get("inf")}
                if n != roots[0].where and nf:
                    counts = {((s.get("nan") or 0), (s.get("inf") or 0)) for s in nf.values()}
                    where = "every rank" if len(nf) == len(live) else f"ranks {sorted(nf)}"
                    if len(counts) == 1:
                        (k_nan, k_inf), = counts
                        follows.append(f"{n}: {k_nan} NaN and {k_inf} Inf values on {where}")
                    else:          # the counts differ by rank: each said
                        follows.append(f"{n}: NaN or Inf values on {where} (" + ", ".join(
                            f"rank {r}: {s.get('nan') or 0} NaN, {s.get('inf') or 0} Inf"
                            for r, s in sorted(nf.items())) + ")")
        said = {f.split(":", 1)[0] for f in follows}
        follows += [f"{n}: ranks {[r for r, s in point_stats[n].items() if s['level'] in ('material', 'shape')]} "
                    f"differ" for n in material if n != roots[0].where and n not in said]
        roots[0].consequences = roots[0].consequences + follows[:64]
    set_findings = capture_mismatches(records) if complete else []
    # ---- coverage: HEALTHY only when the probe saw the whole model -------------------------------
    out["coverage"] = coverage_summary(records, live)
    cov_findings = coverage_findings(records, live, settings, out["coverage"]) if complete else []
    adopt_owed_placements(roots, cov_findings)   # a Partial placement is the root at its layer: one finding
    # a collective left unchecked, for any reason, is counted and said, never under HEALTHY (an unreadable
    # path has its own warning from coverage_findings, which names the path)
    unchecked = {w: n for w, n in (ar.get("unchecked_why") or {}).items() if w != "tensors not readable"}
    if unchecked and complete:
        cov_findings.append(Finding("coverage", "collective audit", list(live), severity=WARNING, detail=(
            "collectives not checked for completeness: " + ", ".join(f"{n} × {w}" for w, n in unchecked.items())
            + " (" + "; ".join(dict.fromkeys(_UNCHECKED_HINT.get(w.split(" ", 1)[0] if w.startswith("op ") else w,
                                                                 "see the audit records in report.json")
                                             for w in unchecked)) + ")"), evidence={"all_ranks": True}))
    findings += roots + wrong + slot_findings + set_findings + cov_findings + basis_findings
    explained = {f.where for f in findings} | ({AUX_PACKED} if slot_findings else set())
    findings += rounding_noise(names, point_stats, explained)
    if references and complete and not any(f.severity == FAILURE for f in findings):
        findings += reference_check(records[ref], references, dtype)
    out["findings"] = [f.to_json() for f in findings]
    return out




def capture_mismatches(records: dict[int, LoadedRank]) -> list[Finding]:
    """Where the ranks captured different points, or a point of another shape or dtype (from each rank's
    record, not its tensors)."""
    return [Finding("capture-mismatch", m["point"], m["ranks"], detail=m["detail"])
            for m in point_set_mismatches({r: rec.meta for r, rec in sorted(records.items())})]
