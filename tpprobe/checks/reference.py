"""The built-in model's unsharded tp=1 reference: when ranks agree with each other but not with it."""
from __future__ import annotations

from ..formats.capture_dir import LoadedRank
from ..capture.points import point_label, stream_order
from .findings import WARNING, Finding
from ..core.noise import RESHARDED, compare, rel_l2


def reference_check(rec: LoadedRank, references, dtype) -> list[Finding]:
    for name in stream_order(references):
        if name in rec.tensors:
            c = compare(rec.tensors[name], references[name].to(rec.tensors[name]), dtype=dtype, context=RESHARDED)
            if c["level"] in ("material", "shape"):
                return [Finding("reference-mismatch", name, [rec.rank], severity=WARNING,
                                detail=f"{point_label(name)} differs from the unsharded tp=1 reference "
                                       f"(relative L2 diff {rel_l2(c.get('rel_diff', 0)):.3g}) while ranks agree",
                                evidence={"all_ranks": True})]
    return []
