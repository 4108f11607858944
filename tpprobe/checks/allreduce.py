"""All-reduce completeness: every audited all-reduce's output against the sum over ranks of its
inputs (exact, within rounding, or incomplete)."""
from __future__ import annotations


def allreduce_audit(ev, records, live, world) -> dict:
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
