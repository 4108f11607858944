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

from .noise import NOISE_ULP, bitwise_equal, coarser, compare, eps_of, nonfinite, nonzero_rows, within_noise
from ..exchange.fingerprint import Fingerprint, fingerprint, sum_matches

LEVELS = ["reference", "share", "bitwise", "noise", "material", "shape"]
SLOT_CANDIDATES = ("embed.out", "layer.0.in_norm", "embed.local")


def judge_dtype(a: torch.dtype, b: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return coarser(coarser(a, b), dtype) if a.is_floating_point else dtype


def layer_points(names) -> list[str]:
    def key(n):
        return int(n.split(".")[1])
    return sorted((n for n in names if n.startswith("layer.") and n.endswith(".out")), key=key)


def slot_candidates(names) -> list[str]:
    return [n for n in SLOT_CANDIDATES if n in names] + layer_points(names)


# ---- fingerprints: equality levels from sketches --------------------------------------------------
def fp_rel(a: Fingerprint, b: Fingerprint) -> float:
    """≈ ||a - b|| / max(||a||, ||b||), from the linear sketches."""
    err = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a.sketch, b.sketch)))
    s = math.sqrt(max(a.sumsq, b.sumsq)) if not (math.isnan(a.sumsq) or math.isnan(b.sumsq)) else float("nan")
    return 0.0 if err == 0 else (err / (math.sqrt(a.k) * s) if s and not math.isnan(s) else float("inf"))


def fp_level(a: Fingerprint, b: Fingerprint, dtype: torch.dtype) -> str:
    """bitwise / noise / material / shape, judged like compare(): noise is a norm-wise difference of a
    few ULP (an eighth of the elementwise bound: rounding spread over every element)."""
    if a.shape != b.shape:
        return "shape"
    if a.bit_hash == b.bit_hash and a.dtype == b.dtype:
        return "bitwise"
    if (a.n_nan, a.n_inf) != (b.n_nan, b.n_inf):
        return "material"
    if a.n_nan or a.n_inf:
        return "material"
    return "noise" if fp_rel(a, b) <= NOISE_ULP.get(dtype, 64.0) * eps_of(dtype) / 8 else "material"


def fp_stats(fp: Fingerprint, base: Fingerprint, dtype: torch.dtype) -> dict:
    lv = fp_level(fp, base, dtype)
    s = {"level": lv, "from": "fingerprint"}
    if lv not in ("bitwise", "shape"):
        rel = fp_rel(fp, base)
        s.update(rel_norm=rel, rel_diff=rel * rel / 2, max_abs=None, first_token=None)
    elif lv == "bitwise":
        s.update(max_abs=0.0, rel_diff=0.0)
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
            if name.endswith(".local"):       # each rank's own share: expected to differ
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

    def allreduce(self, i: int, live: list[int], meta: dict) -> Optional[dict]:
        ins = {r: self.tensor(f"allreduce.{i}.in", r) for r in live}
        outs = {r: self.tensor(f"allreduce.{i}.out", r) for r in live}
        if any(v is None for v in list(ins.values()) + list(outs.values())) \
                or len({tuple(v.shape) for v in ins.values()}) > 1:
            return None
        total = sum(v.float() for v in ins.values())     # within_noise's precision; compare() redoes it in f64
        per = {}
        for r in live:
            c = within_noise(outs[r], total, outs[r].dtype) or \
                compare(outs[r].double(), sum(v.double() for v in ins.values()), dtype=outs[r].dtype)
            per[str(r)] = {"level": c["level"] if c["level"] != "bitwise" else "exact",
                           "rel_diff": c.get("rel_diff", 0.0), "max_abs": c.get("max_abs", 0.0)}
        return per

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        rec = self.records[r]
        packed = rec.tensors.get("aux.packed")
        if packed is None or rec.meta.get("slot_match") is not None:
            # matched on the rank, against every candidate (a fingerprint capture keeps few tensors)
            return rec.meta.get("slot_match")
        names = list(rec.tensors)
        cands = {n: rec.tensors[n] for n in slot_candidates(names)}
        return match_slots(packed, hidden, cands, self.dtype)

    def packed_width(self, r: int) -> Optional[int]:
        p = self.records[r].tensors.get("aux.packed")
        if p is not None:
            return p.shape[-1]
        shape = self.records[r].meta.get("aux", {}).get("shape")
        return shape[-1] if shape else None


class FingerprintEvidence(TensorEvidence):
    """Each rank's fingerprints (its posted metadata) plus the statistics ranks computed locally
    against the reference rank's broadcast tensor where fingerprints disagreed (`detail`)."""

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
            if name.endswith(".local"):
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

    def sum_vs(self, name, live, reference: torch.Tensor) -> str:
        fps = [self.fp(name, r) for r in live]
        ref = fingerprint(reference.to(getattr(torch, fps[0].dtype)), seed=fps[0].seed, k=fps[0].k)
        ok, _ = sum_matches(ref, fps, self.dtype)
        return "noise" if ok else "material"

    def allreduce(self, i: int, live: list[int], meta: dict) -> Optional[dict]:
        recs = [self.records[r].meta["allreduces"][i] for r in live]
        if any("in_fp" not in a or "out_fp" not in a for a in recs):
            return None
        ins = [Fingerprint.from_json(a["in_fp"]) for a in recs]
        per = {}
        for r, a in zip(live, recs):
            out = Fingerprint.from_json(a["out_fp"])
            ok, rel = sum_matches(out, ins, getattr(torch, out.dtype))
            per[str(r)] = {"level": "noise" if ok else "material", "rel_norm": rel}
        return per

    def slot_match(self, r: int, hidden: int) -> Optional[list]:
        return self.records[r].meta.get("slot_match")
