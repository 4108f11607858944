"""All-reduce completeness: every audited collective's output against what its own definition
returns from every rank's input (SUM, AVG, MAX, MIN, PRODUCT; a reduce-scatter's slice of the
reduction, an all-gather's concatenation, an all-to-all's chunks from each sender, bit for bit):
exact, within rounding, or incomplete. What cannot be
checked (tensors not readable, an op the exchange mode cannot judge) is counted under `unchecked`
with the reason, never dropped."""
from __future__ import annotations

# ops each exchange mode can check: full tensors check every op exactly; linear sketches only the
# linear ones (the sketch of a max or a product is not a function of the inputs' sketches) and the
# data movers (an all-gather's CAT, an all-to-all's PERMUTE: each chunk's hash against its sender's)
TENSOR_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "CAT", "PERMUTE")
SKETCH_OPS = ("SUM", "AVG", "CAT", "PERMUTE")


def allreduce_audit(ev, records, live, world) -> dict:
    n = min(len(records[r].meta.collectives) for r in live)
    # tensors: each output against the sum of the inputs, element by element (exact or within rounding);
    # sketch: fingerprints only, which prove a sum complete within rounding, never bit-exact
    method = getattr(ev, "audit_method", "tensors")
    ops = SKETCH_OPS if method == "sketch" else TENSOR_OPS
    res = {"checked": 0, "complete": 0, "noise": 0, "incomplete": 0, "unchecked": 0, "unchecked_why": {},
           "records": [], "method": method}
    for i in range(n):
        m = records[live[0]].meta.collectives[i]
        entry = {k: getattr(m, k) for k in ("seq", "where", "module", "source", "shape", "dtype", "group_size", "op",
                                            "layer", "group")}
        entry.update(kind=m.kind, path=m.path or "torch.distributed.all_reduce")
        why = None
        if not m.checked:
            why = "tensors not readable"
        elif m.op not in ops:
            why = f"op {m.op} not checkable from {'sketches' if method == 'sketch' else 'tensors'}"
        elif len(live) != world:
            why = "not every rank's record"
        per = None if why else ev.allreduce(i, live, m)
        if per is None or isinstance(per, str):
            why = why or per or "tensors not kept"
            entry["level"], entry["unchecked"] = "unchecked", why
            res["unchecked"] += 1
            res["unchecked_why"][why] = res["unchecked_why"].get(why, 0) + 1
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
