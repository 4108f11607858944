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

from ..core.noise import (bitwise_equal, compare, is_noise, judge_dtype, nonfinite, nonzero_rows, reduce_check, ulp_of,
                          within_noise)
from ..capture.points import (AUX_PACKED, EMBED_LOCAL, EMBED_OUT, SHARE, allreduce_in, allreduce_out, in_norm,
                              layer_streams, parse)
from ..fingerprint.reference import (PROBE_K, PROBE_SEED, TORCH_PATH, Fingerprint, fingerprint, host_combine_notes,
                                     sum_matches)

LEVELS = ["reference", "share", "bitwise", "noise", "material", "shape"]
# sketches of the ranks' increments summed against a reference stream's sketch: within this
# relative difference it is that stream (a tp=1 reference differs from a tp run by rounding, 1e-2
# at most in bf16; a stream missing a share of its sum is off by tens of percent)
SKETCH_SUM_REL = 0.05
SLOT_CANDIDATES = (EMBED_OUT, in_norm(0), EMBED_LOCAL)


def layer_points(names) -> list[str]:
    return layer_streams(names)


def slot_candidates(names) -> list[str]:
    return [n for n in SLOT_CANDIDATES if n in names] + layer_points(names)


# ---- fingerprints: equality levels from sketches --------------------------------------------------
def fp_rel(a: Fingerprint, b: Fingerprint) -> float:
    """≈ ||a - b|| / max(||a||, ||b||), from the linear sketches."""
    err = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a.sketch, b.sketch)))
    s = math.sqrt(max(a.sumsq, b.sumsq)) if not (math.isnan(a.sumsq) or math.isnan(b.sumsq)) else float("nan")
    return 0.0 if err == 0 else (err / (math.sqrt(a.k) * s) if s and not math.isnan(s) else float("inf"))


def fp_measure(a: Fingerprint, b: Fingerprint, dtype: torch.dtype) -> dict:
    """What the noise model can judge from two fingerprints: the norm-wise relative error (the
    sketch's estimate, or the exact lower bound | ||a|| - ||b|| | / max(||a||, ||b||) from the sums of
    squares when larger: a drift that scales the stream is measured exactly, not estimated) and a
    lower bound of the worst element's difference (|absmax(a) - absmax(b)|)."""
    est, exact = fp_rel(a, b), 0.0
    na, nb = math.sqrt(max(a.sumsq, 0.0)), math.sqrt(max(b.sumsq, 0.0))
    if math.isfinite(na) and math.isfinite(nb) and max(na, nb) > 0:
        exact = abs(na - nb) / max(na, nb)
    # the rule judges the two apart (noise.SKETCH_SLACK: the estimate spreads, the bound does not)
    m = {"from": "fingerprint", "rel_norm": max(est, exact), "sketch_rel": est, "norm_rel": exact,
         "nan_mismatch": int((a.n_nan, a.n_inf) != (b.n_nan, b.n_inf))}
    if dtype.is_floating_point and math.isfinite(a.absmax) and math.isfinite(b.absmax):
        spacing = float(ulp_of(torch.tensor(max(abs(a.absmax), abs(b.absmax)), dtype=torch.float64), dtype))
        m["ulp_max"] = abs(a.absmax - b.absmax) / spacing if spacing > 0 else 0.0
    return m


def fp_level(a: Fingerprint, b: Fingerprint, dtype: torch.dtype) -> str:
    """bitwise / noise / material / shape: the noise model (core/noise.py) on what fingerprints tell."""
    if a.shape != b.shape:
        return "shape"
    if a.bit_hash == b.bit_hash and a.dtype == b.dtype:
        return "bitwise"
    if (a.n_nan, a.n_inf) != (b.n_nan, b.n_inf) or a.n_nan or a.n_inf:
        return "material"
    return "noise" if is_noise(fp_measure(a, b, dtype), dtype) else "material"


def fp_stats(fp: Fingerprint, base: Fingerprint, dtype: torch.dtype) -> dict:
    lv = fp_level(fp, base, dtype)
    s = {"level": lv, "from": "fingerprint"}
    if lv not in ("bitwise", "shape"):
        rel = fp_measure(fp, base, dtype)["rel_norm"]
        s.update(rel_norm=rel, rel_diff=rel * rel / 2, max_abs=None, first_token=None)
    elif lv == "bitwise":
        s.update(max_abs=0.0, rel_diff=0.0, rel_norm=0.0)
    return s


def fp_dtype(fp: Fingerprint) -> torch.dtype:
    return getattr(torch, fp.dtype)


def bitmap_rows(fp: Fingerprint, n: int) -> torch.Tensor:
    return torch.tensor(fp.nonzero_rows()[:n], dtype=torch.bool)


# ---- slot matching, done where the tensors are ---------------------------------------------------
def match_slots(packed: torch.Tensor, hidden: int, candidates: dict, dtype: torch.dtype) -> list[Optional[str]]:
    """For each hidden-wide slot of the packed aux tensor, the first candidate it equals (bitwise or
    within noise). candidates: name -> tensor or Fingerprint, in preference order."""
    out = []
    for s in packed.split(hidden, dim=-1):
        sfp = None
        # a capture is usually a bitwise copy of its candidate: try that cheap test on all first
        m = next((n for n, c in candidates.items() if not isinstance(c, Fingerprint) and bitwise_equal(s, c)), None)
        for name, c in ({} if m else candidates).items():
            if isinstance(c, Fingerprint):
                sfp = sfp or fingerprint(s, seed=c.seed, k=c.k)
                if fp_level(sfp, c, judge_dtype(s.dtype, fp_dtype(c), dtype)) in ("bitwise", "noise"):
                    m = name
                    break
            elif c.shape == s.shape and within_noise(s, c, judge_dtype(s.dtype, c.dtype, dtype)) is not None:
                m = name
                break
        out.append(m)
    return out


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

    def allreduce(self, i: int, live: list[int], meta: dict) -> Optional[dict]:
        """Each rank's output of collective i against what a complete one returns by its own
        definition (the op over every rank's input; for a reduce-scatter, this rank's chunk of it;
        for an all-gather, the concatenation), and, where it is not that, what it looks like."""
        from ..capture.audit import expected_output
        ins = {r: self.tensor(allreduce_in(i), r) for r in live}
        outs = {r: self.tensor(allreduce_out(i), r) for r in live}
        kind, op = meta.get("kind", "all_reduce"), meta.get("op", "SUM")
        if any(v is None for v in list(ins.values()) + list(outs.values())) \
                or (kind != "all_to_all" and len({tuple(v.shape) for v in ins.values()}) > 1):
            return None
        per = {}
        for j, r in enumerate(live):
            # a sub-group reduce (SGLang's attention-TP group under DP attention) involves its members only
            members = group_members(self.records[r].meta["allreduces"][i], live)
            splits = [self.records[q].meta["allreduces"][i].get("splits") for q in members]
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
        recs = self.records[r].meta.get("allreduces", [])
        for j in range(i - 1, -1, -1):
            if recs[j].get("kind", "all_reduce") == kind:
                t = self.tensor(allreduce_out(j), r)
                if t is not None and tuple(t.shape) == tuple(shape):
                    return t
        return None

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        rec = self.records[r]
        packed = rec.tensors.get(AUX_PACKED)
        if packed is None or rec.meta.get("slot_match") is not None:
            # matched on the rank, against every candidate (a fingerprint capture keeps few tensors)
            return rec.meta.get("slot_match")
        names = list(rec.tensors)
        cands = {n: rec.tensors[n] for n in slot_candidates(names)}
        return match_slots(packed, hidden, cands, self.dtype)

    def packed_width(self, r: int) -> Optional[int]:
        p = self.records[r].tensors.get(AUX_PACKED)
        if p is not None:
            return p.shape[-1]
        shape = self.records[r].meta.get("aux", {}).get("shape")
        return shape[-1] if shape else None


class FingerprintEvidence(TensorEvidence):
    """Each rank's fingerprints (its posted metadata) plus the statistics ranks computed locally
    against the reference rank's broadcast tensor where fingerprints disagreed (`detail`)."""

    audit_method = "sketch"       # all-reduces checked on linear sketches: within rounding, never exact

    def __init__(self, records, dtype: torch.dtype, detail: dict[str, dict[int, dict]]):
        super().__init__(records, dtype)
        self.detail = detail
        self.fps = {r: {n: Fingerprint.from_json(f) for n, f in rec.meta.get("fingerprints", {}).items()}
                    for r, rec in records.items()}

    def fp(self, name, r) -> Optional[Fingerprint]:
        return self.fps.get(r, {}).get(name)

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

    def allreduce(self, i: int, live: list[int], meta: dict) -> Optional[dict]:
        """The same check on sketches (linear: sketch(out) ~ sum of sketches of the inputs; AVG: m
        x sketch(out)); a reduce-scatter is checked chunk by chunk, an all-gather on its output's
        chunks' hashes. No tensor is moved: what a wrong output looks like is read off the sketches
        too (a scaled sum, one rank's input, the previous call's output, zeros)."""
        recs = {r: self.records[r].meta["allreduces"][i] for r in live}
        if any("in_fp" not in a or "out_fp" not in a for a in recs.values()):
            return None
        kind, op = meta.get("kind", "all_reduce"), meta.get("op", "SUM")
        per = {}
        for r in live:
            a = recs[r]
            members = group_members(a, live)
            j = members.index(r)
            if kind == "all_gather":
                if not isinstance(a["out_fp"], list):
                    return "all-gather blocks not readable from the sketches"
                outs = [Fingerprint.from_json(f) for f in a["out_fp"]]
                ins = [Fingerprint.from_json(recs[q]["in_fp"]) for q in members]
                prev = self._previous_fp(i, r, "all_gather", len(outs))
                per[str(r)] = fp_ag_check(outs, dict(zip(members, ins)), prev)
                continue
            if kind == "all_to_all":
                # output chunk q (from rank q) must be bit for bit rank q's input chunk for this rank
                outs, got = a.get("out_fp"), [recs[q].get("in_fp") for q in members]
                if not isinstance(outs, list) or any(not isinstance(g, list) for g in got) \
                        or len(outs) != len(members) or any(len(g) != len(members) for g in got):
                    return "all-to-all split sizes not readable from the sketches"
                wrong = [q for n, q in enumerate(members)
                         if Fingerprint.from_json(outs[n]).bit_hash != Fingerprint.from_json(got[n][j]).bit_hash]
                per[str(r)] = {"level": "material" if wrong else "exact", "rel_norm": None if wrong else 0.0,
                               **({"chunks_wrong": wrong} if wrong else {})}
                continue
            if kind == "reduce_scatter":
                ins = [Fingerprint.from_json(recs[q]["in_fp"][j]) for q in members]
            else:
                ins = [Fingerprint.from_json(recs[q]["in_fp"]) for q in members]
            out = Fingerprint.from_json(a["out_fp"])
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
                prev = self.records[r].meta["allreduces"][i - 1] if i > 0 else None
                prev_fp = Fingerprint.from_json(prev["out_fp"]) if prev and isinstance(prev.get("out_fp"), dict) \
                    else None
                per[str(r)]["looks"] = fp_looks_like(out, dict(zip(members, ins)), prev_fp, getattr(torch, out.dtype))
            elif not ok and kind == "reduce_scatter" and op == "SUM":
                slices = {n: [Fingerprint.from_json(recs[q]["in_fp"][n]) for q in members]
                          for n in range(len(members))}
                per[str(r)]["looks"] = fp_rs_looks_like(out, members, j, slices, getattr(torch, out.dtype))
        return per

    def _previous_fp(self, i: int, r: int, kind: str, n: int) -> Optional[list]:
        """The block fingerprints of rank r's last all-gather of n blocks before collective i."""
        recs = self.records[r].meta.get("allreduces", [])
        for j in range(i - 1, -1, -1):
            if recs[j].get("kind", "all_reduce") == kind:
                o = recs[j].get("out_fp")
                if isinstance(o, list) and len(o) == n:
                    return [Fingerprint.from_json(f) for f in o]
        return None

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        return self.records[r].meta.get("slot_match")


def a2a_check(out: torch.Tensor, exp: torch.Tensor, ins: dict, members: list, r: int, splits: list) -> dict:
    """An all-to-all's output on rank r against what its peers sent it: exact (bit for bit) or
    material, with the source ranks whose chunk is wrong."""
    from ..capture.audit import a2a_chunks
    if tuple(out.shape) != tuple(exp.shape):
        return {"level": "material", "rel_norm": math.inf, "max_abs": math.inf, "chunks_wrong": list(members)}
    o = out.double()
    if bool(torch.equal(o, exp)):
        return {"level": "exact", "rel_norm": 0.0, "max_abs": 0.0}
    sizes = [a2a_chunks(ins[q], splits[n], len(members), True)[members.index(r)].shape[0]
             for n, q in enumerate(members)]
    wrong = [q for q, a, b in zip(members, o.split(sizes, 0), exp.split(sizes, 0)) if not bool(torch.equal(a, b))]
    d = o - exp
    n = float(torch.linalg.vector_norm(exp))
    return {"level": "material", "rel_norm": float(torch.linalg.vector_norm(d)) / n if n else math.inf,
            "max_abs": float(d.abs().max()), "chunks_wrong": wrong}


# ---- an all-gather, block by block ---------------------------------------------------------------
def _ag_block_looks(got_equal, q: int, members: list, zeros: bool, stale: bool) -> dict:
    """What a wrong block in rank q's place is: another rank's block (swapped), the previous
    all-gather's block (a stale buffer: the write never landed), zeros, or none of these."""
    if zeros:
        return {"as": "zeros"}
    other = next((m for m in members if m != q and got_equal(m)), None)
    if other is not None:
        return {"as": "input", "rank": other}
    return {"as": "previous"} if stale else {"as": "other"}


def ag_check(out: torch.Tensor, exp: torch.Tensor, ins: dict, prev: Optional[torch.Tensor]) -> dict:
    """An all-gather's output on one rank against the concatenation of what every rank sent: exact
    (bit for bit) or material, with the ranks whose block is wrong and what each wrong block is."""
    members = list(ins)
    if tuple(out.shape) != tuple(exp.shape):
        return {"level": "material", "rel_norm": math.inf, "max_abs": math.inf, "error": math.inf,
                "chunks_wrong": members}
    o = out.double()
    if bool(torch.equal(o, exp)):
        return {"level": "exact", "rel_norm": 0.0, "max_abs": 0.0}
    sizes = [ins[q].shape[0] if ins[q].dim() else 1 for q in members]
    got, want = o.split(sizes, 0), exp.split(sizes, 0)
    prevs = prev.double().split(sizes, 0) if prev is not None and tuple(prev.shape) == tuple(out.shape) else None
    blocks = {}
    for n, q in enumerate(members):
        if bool(torch.equal(got[n], want[n])):
            continue
        g = got[n]
        blocks[str(q)] = _ag_block_looks(
            lambda m: tuple(ins[m].shape) == tuple(g.shape) and bool(torch.equal(g, ins[m].double())), q, members,
            bool((g == 0).all()) and bool((want[n] != 0).any()),
            prevs is not None and bool(torch.equal(g, prevs[n])))
    d = o - exp
    return {"level": "material", "rel_norm": rel_error(out, exp), "max_abs": float(d.abs().max()),
            "error": rel_error(out, exp), "chunks_wrong": [int(q) for q in blocks],
            "looks": {"as": "blocks", "blocks": blocks}}


def fp_ag_check(outs: list, ins: dict, prev: Optional[list]) -> dict:
    """ag_check() from fingerprints: each output block's hash against its sender's input's (and,
    for a wrong block, against the other ranks' inputs and the previous all-gather's block); the
    relative error estimated from the blocks' sketches."""
    members = list(ins)
    if len(outs) != len(members):
        return {"level": "material", "rel_norm": None, "error": math.inf, "chunks_wrong": members}
    blocks = {}
    for n, q in enumerate(members):
        g = outs[n]
        if g.bit_hash == ins[q].bit_hash:
            continue
        blocks[str(q)] = _ag_block_looks(lambda m: ins[m].bit_hash == g.bit_hash, q, members,
                                         g.sumsq == 0.0 and ins[q].sumsq != 0.0,
                                         prev is not None and prev[n].bit_hash == g.bit_hash)
    if not blocks:
        return {"level": "exact", "rel_norm": 0.0}
    k = outs[0].k
    err2 = math.fsum((x - y) ** 2 for o, q in zip(outs, members) for x, y in zip(o.sketch, ins[q].sketch))
    norm2 = math.fsum(ins[q].sumsq for q in members)
    err = math.sqrt(err2 / k) / math.sqrt(norm2) if norm2 > 0 else math.inf
    return {"level": "material", "rel_norm": err, "error": err, "chunks_wrong": [int(q) for q in blocks],
            "looks": {"as": "blocks", "blocks": blocks}}


def rel_error(out: torch.Tensor, exp: torch.Tensor) -> float:
    """||out - expected|| / ||expected||: how far a collective's output is from what a complete one
    returns (a sum scaled by f: |f - 1|; one of two equal, independent shares alone: about 0.7)."""
    if tuple(out.shape) != tuple(exp.shape):
        return math.inf
    d = float(torch.linalg.vector_norm(out.double() - exp.double()))
    n = float(torch.linalg.vector_norm(exp.double()))
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


def fp_rel_error(out_sketch: list, exp_sketch: list) -> float:
    """rel_error() from linear sketches: ||sk(out) - sk(expected)|| / ||sk(expected)|| (exact for a
    scaled output, whose difference is a multiple of the expected; an estimate otherwise)."""
    d = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(out_sketch, exp_sketch)))
    n = math.sqrt(math.fsum(y * y for y in exp_sketch))
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


# ---- what a wrong reduce output looks like -------------------------------------------------------
def group_members(rec: dict, live: list[int]) -> list[int]:
    """The ranks a collective sums over: its sub-group's when it has one, else every live rank."""
    return [q for q in (rec.get("group_ranks") or live) if q in live]


def _scale_ok(resid: float, norm: float, dtype: torch.dtype, ranks: int) -> bool:
    from ..core.noise import reduce_bound
    return norm > 0 and resid <= reduce_bound(dtype, ranks) * norm


def looks_like(out: torch.Tensor, exp: torch.Tensor, ins: dict, prev: Optional[torch.Tensor],
               dtype: torch.dtype) -> dict:
    """What an all-reduce output that is not the sum is: zeros, one rank's input handed back, the
    previous call's output (a stale buffer), the sum scaled by a factor, or none of these."""
    o, e = out.double(), exp.double()
    no = float(torch.linalg.vector_norm(o))
    if no == 0.0:
        return {"as": "zeros"}
    for q, t in ins.items():
        if t.shape == out.shape and _scale_ok(float(torch.linalg.vector_norm(o - t.double())), no, dtype, 1):
            return {"as": "input", "rank": q}
    if prev is not None and prev.shape == out.shape and \
            _scale_ok(float(torch.linalg.vector_norm(o - prev.double())), no, dtype, 1):
        return {"as": "previous"}
    ee = float((e * e).sum())
    if ee > 0:
        alpha = float((o * e).sum()) / ee
        if _scale_ok(float(torch.linalg.vector_norm(o - alpha * e)), no, dtype, len(ins)):
            return {"as": "scaled", "factor": alpha}
    return {"as": "other"}


def rs_looks_like(out: torch.Tensor, ins: dict, j: int, dtype: torch.dtype) -> dict:
    """What a reduce-scatter output that is not this rank's (j-th) slice of the sum is: zeros, one
    rank's own slice alone (the sum never happened: the unsummed local slice), this slice of the sum
    scaled by a factor, another rank's slice of the sum (a wrong offset), or none of these."""
    members = list(ins)
    m = len(members)
    if any(not t.dim() or t.shape[0] % m for t in ins.values()):
        return {"as": "other"}
    parts = {q: t.double().chunk(m, 0) for q, t in ins.items()}
    total = [sum(parts[q][n] for q in members) for n in range(m)]
    lk = looks_like(out, total[j], {q: parts[q][j] for q in members}, None, dtype)
    if lk["as"] != "other":
        return lk
    no = float(torch.linalg.vector_norm(out.double()))
    for n, q in enumerate(members):
        if n != j and total[n].shape == out.shape and \
                _scale_ok(float(torch.linalg.vector_norm(out.double() - total[n])), no, dtype, m):
            return {"as": "slice", "rank": q}
    return lk


def fp_rs_looks_like(out: Fingerprint, members: list, j: int, slices: dict, dtype: torch.dtype) -> dict:
    """rs_looks_like() from fingerprints: slices[n] holds every member's sketch of its input's n-th
    chunk, so slice n of the sum has their summed sketch."""
    from ..core.noise import reduce_bound
    lk = fp_looks_like(out, dict(zip(members, slices[j])), None, dtype)
    if lk["as"] != "other":
        return lk
    no, k = math.sqrt(out.sumsq), out.k
    tol = 2.0 * reduce_bound(dtype, len(members))
    for n, q in enumerate(members):
        if n != j and all(f.shape == out.shape for f in slices[n]):
            se = [math.fsum(f.sketch[x] for f in slices[n]) for x in range(k)]
            if _fp_resid(out.sketch, se, no, k) <= tol:
                return {"as": "slice", "rank": q}
    return lk


def scaled_fp(f: Fingerprint, c: float) -> Fingerprint:
    """The fingerprint of c x the tensor (its sketch and sums; the hash is no longer the tensor's)."""
    return Fingerprint(shape=f.shape, dtype=f.dtype, bit_hash="scaled:" + f.bit_hash, sketch=[c * x for x in f.sketch],
                       sumsq=c * c * f.sumsq, absmax=abs(c) * f.absmax, n_nan=f.n_nan, n_inf=f.n_inf,
                       row_nonzero=f.row_nonzero, seed=f.seed)


def _fp_resid(a: list, b: list, norm: float, k: int) -> float:
    """||a - b|| / (sqrt(k) x norm) from two sketches: the sketch's estimate of a relative difference."""
    if norm <= 0:
        return math.inf
    return math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a, b))) / (math.sqrt(k) * norm)


def fp_looks_like(out: Fingerprint, ins: dict, prev: Optional[Fingerprint], dtype: torch.dtype) -> dict:
    """looks_like() from fingerprints alone: the sketch is linear, so the sum's sketch is the sum of
    the inputs' and the best factor is <sk(out), sk(sum)> / <sk(sum), sk(sum)>."""
    from ..core.noise import reduce_bound
    if out.sumsq == 0.0:
        return {"as": "zeros"}
    no, k = math.sqrt(out.sumsq), out.k
    tol = 2.0 * reduce_bound(dtype, len(ins))      # the sketch's estimate spreads: twice the bound
    for q, f in ins.items():
        if f.bit_hash == out.bit_hash or _fp_resid(out.sketch, f.sketch, no, k) <= tol:
            return {"as": "input", "rank": q}
    if prev is not None and prev.shape == out.shape and \
            (prev.bit_hash == out.bit_hash or _fp_resid(out.sketch, prev.sketch, no, k) <= tol):
        return {"as": "previous"}
    se = [math.fsum(f.sketch[j] for f in ins.values()) for j in range(k)]
    ee = math.fsum(x * x for x in se)
    if ee > 0:
        alpha = math.fsum(x * y for x, y in zip(out.sketch, se)) / ee
        if _fp_resid(out.sketch, [alpha * x for x in se], no, k) <= tol:
            return {"as": "scaled", "factor": alpha}
    return {"as": "other"}


def looks_text(lk: Optional[dict], op: str = "SUM", kind: str = "all_reduce") -> str:
    what = "sum" if op in ("SUM", "", None) else f"{op} reduction"
    if kind == "all_gather":
        blocks = (lk or {}).get("blocks") or {}
        if not blocks:
            return "not the concatenation of what the ranks sent"
        return " and ".join(
            {"zeros": f"zeros in rank {q}'s block",
             "input": f"rank {b.get('rank')}'s block in rank {q}'s place",
             "previous": f"a stale block in rank {q}'s place (the previous all-gather's: that write never landed)"}.get(
                b.get("as"), f"a wrong block in rank {q}'s place (not what rank {q} sent)")
            for q, b in blocks.items())
    if kind == "reduce_scatter":
        if not lk:
            return f"not its slice of the {what} of its inputs"
        return {"zeros": "zeros",
                "input": f"rank {lk.get('rank')}'s own slice of its input alone (the sum never happened)",
                "slice": f"rank {lk.get('rank')}'s slice of the {what} (not its own)",
                "scaled": f"its slice of the {what} scaled by {lk.get('factor', float('nan')):.4g}"}.get(
            lk["as"], f"not its slice of the {what} (nor a scaled slice, another rank's slice, one rank's own "
                      f"slice or zeros)")
    if not lk:
        return f"not the {what} of its inputs"
    return {"zeros": "zeros",
            "input": f"rank {lk.get('rank')}'s input alone (the {'sum' if what == 'sum' else 'reduce'} never happened)",
            "previous": "the previous all-reduce's output (a stale buffer)",
            "scaled": f"the {what} scaled by {lk.get('factor', float('nan')):.4g}"}.get(
        lk["as"], f"not the {what} of its inputs (nor a scaled {what}, one rank's input, zeros or the previous output)")


# ---- what a rank sends instead of its tensors (--exchange fingerprint) ---------------------------
def _fp_json(fp):
    """A fingerprint, or a list of them (a reduce-scatter's input / all-gather's output, per chunk)."""
    return [f.to_json() for f in fp] if isinstance(fp, list) else fp.to_json()


def add_fingerprints(meta: dict, tap, packed: Optional[torch.Tensor], hidden: int, dtype: torch.dtype) -> None:
    """Into this rank's metadata: every capture point's fingerprint, each audited collective's, and
    which candidate each aux slot equals (measured here, where the tensors are)."""
    fps = {n: f.to_json() for n, f in tap.summaries.items()}
    if packed is not None:
        fps[AUX_PACKED] = fingerprint(packed, seed=PROBE_SEED, k=PROBE_K).to_json()
    meta["fingerprints"] = fps
    if str(meta.get("device", "")).startswith("cuda"):
        if TORCH_PATH:                   # why the fused kernel was not used
            meta["fingerprint_torch_path"] = dict(TORCH_PATH)
        notes = host_combine_notes()     # why its partials were combined on the host, not the device
        if notes:
            meta["fingerprint_host_combine"] = notes
    for m, rec in zip(meta["allreduces"], tap.allreduces):
        if rec.inp_summary is not None and rec.out_summary is not None:
            m["in_fp"], m["out_fp"] = _fp_json(rec.inp_summary), _fp_json(rec.out_summary)
    if packed is not None:
        cands = {n: tap.captures[n] if n in tap.captures else tap.summaries[n]
                 for n in slot_candidates(tap.order) if n in tap.captures or n in tap.summaries}
        meta["slot_match"] = match_slots(packed, hidden, cands, dtype)
