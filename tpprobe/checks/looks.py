"""What a collective's output is when it is not what a complete one returns.

Block by block for the data movers (an all-to-all's chunks, an all-gather's blocks: exact or which
rank's block is wrong and what it holds instead), and for a reduce the shapes a wrong output takes
(zeros, one rank's input, the previous call's output, a scaled sum, another rank's slice), from full
tensors or from fingerprints' linear sketches; `looks_text` says it in words. checks/evidence.py asks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..fingerprint.reference import Fingerprint


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
def group_members(rec, live: list[int]) -> list[int]:
    """The ranks a collective (a capture.schema.Collective) sums over: its sub-group's when it has one, else
    every live rank."""
    return [q for q in (rec.group_ranks or live) if q in live]


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
