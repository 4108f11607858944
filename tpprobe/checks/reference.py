"""The built-in model's unsharded tp=1 reference: when ranks agree with each other but not with it."""
from __future__ import annotations

from ..capture.files import RankRecord
from ..capture.points import point_label, stream_order
from .findings import WARNING, Finding
from .noise import compare


def reference_check(rec: RankRecord, references, dtype) -> list[Finding]:
    for name in stream_order(references):
        if name in rec.tensors:
            c = compare(rec.tensors[name], references[name].to(rec.tensors[name]), dtype=dtype)
            if c["level"] in ("material", "shape"):
                return [Finding("reference-mismatch", name, [rec.rank], severity=WARNING,
                                detail=f"{point_label(name)} differs from the unsharded tp=1 reference "
                                       f"(rel diff {c.get('rel_diff', 0):.3g}) while ranks agree",
                                evidence={"all_ranks": True})]
    return []
