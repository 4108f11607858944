"""All-reduce completeness: every audited all-reduce's output against the sum over ranks of its
inputs (exact, within rounding, or incomplete)."""
from __future__ import annotations


def allreduce_audit(ev, records, live, world) -> dict:
    n = min(len(records[r].meta.get("allreduces", [])) for r in live)
    # tensors: each output against the sum of the inputs, element by element (exact or within rounding);
    # sketch: fingerprints only, which prove a sum complete within rounding, never bit-exact
    res = {"checked": 0, "complete": 0, "noise": 0, "incomplete": 0, "records": [],
           "method": getattr(ev, "audit_method", "tensors")}
    for i in range(n):
        metas = [records[r].meta["allreduces"][i] for r in live]
        m = metas[0]
        entry = {k: m[k] for k in ("seq", "where", "module", "source", "shape", "dtype", "group_size", "op")}
        entry.update(kind=m.get("kind", "all_reduce"), path=m.get("path", "torch.distributed.all_reduce"))
        per = ev.allreduce(i, live, m) if m["op"] in ("SUM", "CAT") and len(live) == world \
            and m.get("checked", True) else None
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
