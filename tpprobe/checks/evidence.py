"""What the checks measure, from full tensors or from fingerprints.

The diagnosis in checks/ asks a few questions of the evidence: per capture point, how each rank
compares to the reference rank; which ranks hold equal values; which token rows are non-zero;
whether each audited all-reduce output is the sum of its inputs; which candidate each aux slot
equals. `TensorEvidence` answers from every rank's tensors (`--exchange full`, and offline).
`FingerprintEvidence` answers from each rank's fingerprints plus the detailed statistics the
ranks computed locally where fingerprints disagreed (`--exchange fingerprint`), so the same
diagnosis runs on a few KB per capture.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.noise import LEVEL_ORDER, compare, judge_dtype, nonfinite, nonzero_rows, reduce_check
from ..capture.points import AUX_PACKED, SHARE, allreduce_in, allreduce_out, parse
from ..capture.schema import Collective
from ..capture.slots import match_slots, slot_candidates
from ..fingerprint.levels import fp_dtype, fp_level, fp_measure
from ..fingerprint.reference import Fingerprint, fingerprint, sum_matches
from .looks import (a2a_check, ag_check, fp_ag_check, fp_looks_like, fp_rel_error, fp_rs_looks_like, group_members,
                    looks_like, rel_error, rs_looks_like, scaled_fp)

LEVELS = list(LEVEL_ORDER)          # core/noise.py declares the levels, best first
# sketches of the ranks' increments summed against a reference stream's sketch: within this
# relative difference it is that stream (a tp=1 reference differs from a tp run by rounding, 1e-2
# at most in bf16; a stream missing a share of its sum is off by tens of percent)
SKETCH_SUM_REL = 0.05


def fp_stats(fp: Fingerprint, base: Fingerprint, dtype: torch.dtype) -> dict:
    lv = fp_level(fp, base, dtype)
    s = {"level": lv, "from": "fingerprint"}
    if lv not in ("bitwise", "shape"):
        rel = fp_measure(fp, base, dtype)["rel_norm"]
        s.update(rel_norm=rel, rel_diff=rel * rel / 2, max_abs=None, first_token=None)
    elif lv == "bitwise":
        s.update(max_abs=0.0, rel_diff=0.0, rel_norm=0.0)
    return s


def bitmap_rows(fp: Fingerprint, n: int) -> torch.Tensor:
    return torch.tensor(fp.nonzero_rows()[:n], dtype=torch.bool)


class TensorEvidence:
    """Every rank's tensors are here (rank 0 after a full gather, or read from a capture folder)."""

    audit_method = "tensors"      # all-reduces checked element by element

    def __init__(self, records, dtype: torch.dtype):
        self.records, self.dtype = records, dtype

    def tensor(self, name, r):
        return self.records[r].tensors.get(name)

    def point_stats(self, name: str, live: list[int], ref: int) -> dict[int, dict]:
        have = {r: self.tensor(name, r) for r in live if self.tensor(name, r) is not None}
        if not have:
            return {}
        base = have.get(ref, next(iter(have.values())))
        per = {}
        for r, t in have.items():
            if parse(name).kind == SHARE:       # each rank's own share: expected to differ
                s = {"level": "reference" if t is base else "share"}
            elif t is base:
                s = {"level": "reference"}
            else:
                s = compare(t, base, dtype=judge_dtype(t.dtype, base.dtype, self.dtype))
            s.update(dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape),
                     **{k: v for k, v in nonfinite(t).items() if k in ("nan", "inf")})
            per[r] = s
        return per

    def same(self, name, r1, r2) -> bool:
        a, b = self.tensor(name, r1), self.tensor(name, r2)
        return compare(a, b)["level"] in ("bitwise", "noise")

    def rows_nonzero(self, name, r) -> Optional[torch.Tensor]:
        t = self.tensor(name, r)
        return None if t is None else nonzero_rows(t)

    def sum_vs(self, name, live, reference: torch.Tensor) -> str:
        s = sum(self.tensor(name, r).double() for r in live)
        return compare(s, reference.double(), dtype=self.dtype)["level"]

    def increments(self, out: str, inp: str, live) -> Optional[dict]:
        """Each rank's increment over a layer (its output minus its input), flat, in float64."""
        ts = {r: (self.tensor(out, r), self.tensor(inp, r)) for r in live}
        if any(o is None or i is None or o.shape != i.shape for o, i in ts.values()):
            return None
        return {r: (o.double() - i.double()).flatten() for r, (o, i) in ts.items()}

    def increments_sum_vs(self, out: str, inp: str, live, reference: torch.Tensor) -> Optional[str]:
        """The stream the ranks' increments sum to (input + the sum of the increments) against a
        reference stream: bitwise / noise when the increments are the shares of its increment."""
        from ..core.noise import RESHARDED
        inc = self.increments(out, inp, live)
        if inc is None or reference.numel() != inc[live[0]].numel():
            return None
        s = self.tensor(inp, live[0]).double().flatten() + sum(inc.values())
        return compare(s, reference.double().flatten(), dtype=self.dtype, context=RESHARDED)["level"]

    def allreduce(self, i: int, live: list[int], meta: Collective) -> Optional[dict]:
        """Each rank's output of collective i against what a complete one returns by its own
        definition (the op over every rank's input; for a reduce-scatter, this rank's chunk of it;
        for an all-gather, the concatenation), and, where it is not that, what it looks like."""
        from ..capture.audit import expected_output
        ins = {r: self.tensor(allreduce_in(i), r) for r in live}
        outs = {r: self.tensor(allreduce_out(i), r) for r in live}
        kind, op = meta.kind, meta.op
        if any(v is None for v in list(ins.values()) + list(outs.values())) \
                or (kind != "all_to_all" and len({tuple(v.shape) for v in ins.values()}) > 1):
            return None
        per = {}
        for j, r in enumerate(live):
            # a sub-group reduce (SGLang's attention-TP group under DP attention) involves its members only
            members = group_members(self.records[r].meta.collectives[i], live)
            splits = [self.records[q].meta.collectives[i].splits for q in members]
            exp = expected_output(kind, [ins[q] for q in members], members.index(r), len(members), op, splits)
            if exp is None:
                return None
            if kind == "all_to_all":       # data moved, not summed: every chunk bit for bit what its sender sent
                per[str(r)] = a2a_check(outs[r], exp, ins, members, r, splits)
                continue
            if kind == "all_gather":       # data moved: each block bit for bit what its rank sent
                prev = self._previous(i, r, "all_gather", outs[r].shape)
                per[str(r)] = ag_check(outs[r], exp, {q: ins[q] for q in members}, prev)
                continue
            # the terms the output is a sum of (the rounding bound, the ring orders a backend adds in): a
            # mean's are the inputs / m (never the inputs themselves: the sum handed back for a mean is
            # bit for bit their sum); a MAX / MIN / PRODUCT is judged against its one exact result
            terms = [ins[q] for q in members] if op in ("SUM", "CAT") else \
                [ins[q].double() / len(members) for q in members] if op == "AVG" else [exp]
            c = reduce_check(outs[r], terms, exp, outs[r].dtype)
            per[str(r)] = {"level": c["level"], "rel_norm": c["rel_norm"], "max_abs": c["max_abs"]}
            if c["level"] == "material":
                per[str(r)]["error"] = rel_error(outs[r], exp)
            if c["level"] == "material" and kind == "all_reduce":
                prev = self.tensor(allreduce_out(i - 1), r) if i > 0 else None
                per[str(r)]["looks"] = looks_like(outs[r], exp, {q: ins[q] for q in members}, prev, outs[r].dtype)
            elif c["level"] == "material" and kind == "reduce_scatter" and op == "SUM":
                per[str(r)]["looks"] = rs_looks_like(outs[r], {q: ins[q] for q in members}, members.index(r),
                                                     outs[r].dtype)
        return per

    def _previous(self, i: int, r: int, kind: str, shape) -> Optional[torch.Tensor]:
        """Rank r's output of the last collective of this kind and shape before collective i (what a
        buffer not written this time still holds)."""
        recs = self.records[r].meta.collectives
        for j in range(i - 1, -1, -1):
            if recs[j].kind == kind:
                t = self.tensor(allreduce_out(j), r)
                if t is not None and tuple(t.shape) == tuple(shape):
                    return t
        return None

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        rec = self.records[r]
        packed = rec.tensors.get(AUX_PACKED)
        if packed is None or rec.meta.slot_match is not None:
            # matched on the rank, against every candidate (a fingerprint capture keeps few tensors)
            return rec.meta.slot_match
        names = list(rec.tensors)
        cands = {n: rec.tensors[n] for n in slot_candidates(names)}
        return match_slots(packed, hidden, cands, self.dtype)

    def points_equal(self, r: int, a: str, b: str) -> bool:
        """Capture points a and b hold the same values on rank r, bit for bit: a stream a layer added nothing to is
        its previous point too (within noise is not enough: a slot one layer off differs from its point that little)."""
        ta, tb = self.tensor(a, r), self.tensor(b, r)
        return ta is not None and tb is not None and ta.dtype == tb.dtype and torch.equal(ta, tb)

    def slot_differs(self, i: int, hidden: int, live: list[int]) -> Optional[list[int]]:
        """Ranks whose slot i of the packed aux differs materially from the first live rank's (a slot can
        equal no stream and still differ across ranks); None where some rank's packed aux is not held."""
        packed = {r: self.records[r].tensors.get(AUX_PACKED) for r in live}
        if not live or any(t is None or t.shape[-1] < (i + 1) * hidden for t in packed.values()):
            return None
        base = packed[live[0]][..., i * hidden:(i + 1) * hidden]
        out = []
        for r in live[1:]:
            t = packed[r][..., i * hidden:(i + 1) * hidden]
            if t.shape != base.shape or compare(t, base, dtype=judge_dtype(t.dtype, base.dtype, self.dtype))[
                    "level"] in ("material", "shape"):
                out.append(r)
        return out

    def packed_width(self, r: int) -> Optional[int]:
        p = self.records[r].tensors.get(AUX_PACKED)
        if p is not None:
            return p.shape[-1]
        aux = self.records[r].meta.aux
        shape = aux.shape if aux else None
        return shape[-1] if shape else None


class FingerprintEvidence(TensorEvidence):
    """Each rank's fingerprints (its posted metadata) plus the statistics ranks computed locally
    against the reference rank's broadcast tensor where fingerprints disagreed (`detail`)."""

    audit_method = "sketch"       # all-reduces checked on linear sketches: within rounding, never exact

    def __init__(self, records, dtype: torch.dtype, detail: dict[str, dict[int, dict]]):
        super().__init__(records, dtype)
        self.detail = detail
        self.fps = {r: {n: Fingerprint.from_json(f) for n, f in (rec.meta.fingerprints or {}).items()}
                    for r, rec in records.items()}

    def fp(self, name, r) -> Optional[Fingerprint]:
        return self.fps.get(r, {}).get(name)

    def points_equal(self, r: int, a: str, b: str) -> bool:
        fa, fb = self.fp(a, r), self.fp(b, r)
        return fa is not None and fb is not None and fp_level(fa, fb, self.dtype) == "bitwise"

    def slot_differs(self, i: int, hidden: int, live: list[int]) -> Optional[list[int]]:
        """As TensorEvidence's, from the fingerprint each rank took of a slot that equals no capture point
        (`slot_fps`); None where a rank has none (its slot equals a point: that point's row says)."""
        got = {r: (self.records[r].meta.slot_fps or {}).get(str(i)) for r in live}
        if not live or any(f is None for f in got.values()):
            return None
        fps = {r: Fingerprint.from_json(f) for r, f in got.items()}
        base = fps[live[0]]

        def level(f):
            return fp_stats(f, base, judge_dtype(fp_dtype(f), fp_dtype(base), self.dtype))["level"]
        return [r for r in live[1:] if level(fps[r]) in ("material", "shape")]

    def point_stats(self, name: str, live: list[int], ref: int) -> dict[int, dict]:
        have = {r: self.fp(name, r) for r in live if self.fp(name, r) is not None}
        if not have:
            return {}
        base_rank = ref if ref in have else next(iter(have))
        base = have[base_rank]
        per = {}
        for r, f in have.items():
            if parse(name).kind == SHARE:
                s = {"level": "reference" if r == base_rank else "share"}
            elif r == base_rank:
                s = {"level": "reference"}
            elif name in self.detail and r in self.detail[name]:
                s = dict(self.detail[name][r])
            else:
                s = fp_stats(f, base, judge_dtype(fp_dtype(f), fp_dtype(base), self.dtype))
            s.update(dtype=f.dtype, shape=list(f.shape), nan=f.n_nan, inf=f.n_inf)
            per[r] = s
        return per

    def same(self, name, r1, r2) -> bool:
        a, b = self.fp(name, r1), self.fp(name, r2)
        return fp_level(a, b, self.dtype) in ("bitwise", "noise")

    def rows_nonzero(self, name, r) -> Optional[torch.Tensor]:
        f = self.fp(name, r)
        return None if f is None or not f.row_nonzero else bitmap_rows(f, f.shape[0])

    def increments(self, out: str, inp: str, live) -> Optional[dict]:
        """The sketches of each rank's increment (linear: sketch(out) - sketch(in))."""
        fs = {r: (self.fp(out, r), self.fp(inp, r)) for r in live}
        if any(o is None or i is None or o.shape != i.shape or o.k != i.k for o, i in fs.values()):
            return None
        return {r: torch.tensor(o.sketch, dtype=torch.float64) - torch.tensor(i.sketch, dtype=torch.float64)
                for r, (o, i) in fs.items()}

    def increments_sum_vs(self, out: str, inp: str, live, reference: torch.Tensor) -> Optional[str]:
        inc = self.increments(out, inp, live)
        base = self.fp(inp, live[0])
        if inc is None:
            return None
        ref = fingerprint(reference.to(getattr(torch, base.dtype)), seed=base.seed, k=base.k)
        s = torch.tensor(base.sketch, dtype=torch.float64) + sum(inc.values())
        r = torch.tensor(ref.sketch, dtype=torch.float64)
        # the sketch's estimate of the relative difference; a partial sum misses O(1) of the stream
        rel = float(torch.linalg.vector_norm(s - r) / max(float(torch.linalg.vector_norm(r)), 1e-300))
        return "noise" if rel <= SKETCH_SUM_REL else "material"

    def sum_vs(self, name, live, reference: torch.Tensor) -> str:
        fps = [self.fp(name, r) for r in live]
        ref = fingerprint(reference.to(getattr(torch, fps[0].dtype)), seed=fps[0].seed, k=fps[0].k)
        ok, _ = sum_matches(ref, fps, self.dtype)
        return "noise" if ok else "material"

    def allreduce(self, i: int, live: list[int], meta: Collective) -> Optional[dict]:
        """The same check on sketches (linear: sketch(out) ~ sum of sketches of the inputs; AVG: m
        x sketch(out)); a reduce-scatter is checked chunk by chunk, an all-gather on its output's
        chunks' hashes. No tensor is moved: what a wrong output looks like is read off the sketches
        too (a scaled sum, one rank's input, the previous call's output, zeros)."""
        recs = {r: self.records[r].meta.collectives[i] for r in live}
        if any(a.in_fp is None or a.out_fp is None for a in recs.values()):
            return None
        kind, op = meta.kind, meta.op
        per = {}
        for r in live:
            a = recs[r]
            members = group_members(a, live)
            j = members.index(r)
            if kind == "all_gather":
                if not isinstance(a.out_fp, list):
                    return "all-gather blocks not readable from the sketches"
                outs = [Fingerprint.from_json(f) for f in a.out_fp]
                ins = [Fingerprint.from_json(recs[q].in_fp) for q in members]
                prev = self._previous_fp(i, r, "all_gather", len(outs))
                per[str(r)] = fp_ag_check(outs, dict(zip(members, ins)), prev)
                continue
            if kind == "all_to_all":
                # output chunk q (from rank q) must be bit for bit rank q's input chunk for this rank
                outs, got = a.out_fp, [recs[q].in_fp for q in members]
                if not isinstance(outs, list) or any(not isinstance(g, list) for g in got) \
                        or len(outs) != len(members) or any(len(g) != len(members) for g in got):
                    return "all-to-all split sizes not readable from the sketches"
                wrong = [q for n, q in enumerate(members)
                         if Fingerprint.from_json(outs[n]).bit_hash != Fingerprint.from_json(got[n][j]).bit_hash]
                per[str(r)] = {"level": "material" if wrong else "exact", "rel_norm": None if wrong else 0.0,
                               **({"chunks_wrong": wrong} if wrong else {})}
                continue
            if kind == "reduce_scatter":
                ins = [Fingerprint.from_json(recs[q].in_fp[j]) for q in members]
            else:
                ins = [Fingerprint.from_json(recs[q].in_fp) for q in members]
            out = Fingerprint.from_json(a.out_fp)
            if any(f.n_nan or f.n_inf for f in [out, *ins]):
                # NaN / Inf cannot be summed on sketches (the non-finite check names where they start)
                return "non-finite values (a sketch cannot sum them)"
            if op == "AVG":
                out = scaled_fp(out, float(len(members)))
            ok, rel = sum_matches(out, ins, getattr(torch, out.dtype))
            per[str(r)] = {"level": "noise" if ok else "material", "rel_norm": rel}
            if not ok:
                per[str(r)]["error"] = fp_rel_error(out.sketch, [math.fsum(f.sketch[n] for f in ins)
                                                                 for n in range(out.k)])
            if not ok and kind == "all_reduce" and op == "SUM":
                prev = self.records[r].meta.collectives[i - 1] if i > 0 else None
                prev_fp = Fingerprint.from_json(prev.out_fp) if prev and isinstance(prev.out_fp, dict) else None
                per[str(r)]["looks"] = fp_looks_like(out, dict(zip(members, ins)), prev_fp, getattr(torch, out.dtype))
            elif not ok and kind == "reduce_scatter" and op == "SUM":
                slices = {n: [Fingerprint.from_json(recs[q].in_fp[n]) for q in members]
                          for n in range(len(members))}
                per[str(r)]["looks"] = fp_rs_looks_like(out, members, j, slices, getattr(torch, out.dtype))
        return per

    def _previous_fp(self, i: int, r: int, kind: str, n: int) -> Optional[list]:
        """The block fingerprints of rank r's last all-gather of n blocks before collective i."""
        recs = self.records[r].meta.collectives
        for j in range(i - 1, -1, -1):
            if recs[j].kind == kind:
                o = recs[j].out_fp
                if isinstance(o, list) and len(o) == n:
                    return [Fingerprint.from_json(f) for f in o]
        return None

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        return self.records[r].meta.slot_match
