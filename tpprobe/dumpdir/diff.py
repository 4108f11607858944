"""`tpprobe diff B T` on two dumper folders: each record unsharded to its full tensor, then compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .check import DUMP_DIVERGENCE, differs, rank_words, sum_over
from .measure import measure, one_thread
from ..checks.findings import WARNING, Finding, exit_code
from ..core.errors import CaptureError, UsageError
from ..core.noise import rel_l2
from ..formats.sglang_dump import DumpFile, DumpRun, load, peek, scan, token_dim, tp_layout, tp_of

SCHEMA_DIFF = "tpprobe.dumper-diff/1"


# ---- two runs: diff ------------------------------------------------------------------------------------
REPLICA = "inferred: rank 0 equals the other side"     # no dims; a replica on which some ranks diverged


@dataclass
class Full:
    """One side's record of (name, step), unsharded to the full tensor."""
    value: torch.Tensor
    how: str            # how it was unsharded
    source: str         # dims | inferred | tp 1
    tdim: int
    odd_ranks: list = field(default_factory=list)       # declared replicated, but these ranks differ from the first
    sum_all: Optional[torch.Tensor] = None              # then: Σ over ranks, to name a partial
    replica: Optional[tuple] = None     # no dims, ranks differ: (the first rank's value, that rank, the ranks
    #                                     that differ from it), for when it, not the sum, equals the other side


def unshard(run: DumpRun, key, other_shape: Optional[tuple]) -> Full:
    """The full tensor of one group: tp ranks concatenated, summed or the replica, as the meta's dims
    say, or as inferred from the values (and the other side's shape) when they say nothing. Holds
    the result and at most two rank records at a time."""
    by_rank = run.groups[key]
    ranks = sorted(by_rank)
    shape0, meta0 = peek(by_rank[ranks[0]])
    _r, tp_size, _src = tp_of(meta0, by_rank[ranks[0]])
    lay = tp_layout(meta0.get("dims"))
    tdim = token_dim(meta0.get("dims"))
    if len(ranks) == 1 or tp_size == 1:
        return Full(_tensor(by_rank[ranks[0]]), "as is" if tp_size == 1 else f"rank {ranks[0]} only",
                    "tp 1" if tp_size == 1 else "one file", tdim)
    if lay and lay[0] == "sharded":
        return Full(_concat(by_rank, ranks, lay[1]), f"cat dim {lay[1]} × {len(ranks)} ranks", "dims", tdim)
    if lay and lay[0] == "partial":
        return Full(sum_over(by_rank, ranks, tdim, masks=False)[0], f"Σ {len(ranks)} ranks", "dims", tdim)
    if not lay and other_shape is not None and shape0 is not None and len(other_shape) == len(shape0):
        # the token dim may differ (the runs batch differently); a shard shows in another dim
        diffs = [i for i, (a, b) in enumerate(zip(shape0, other_shape)) if a != b and i != tdim]
        if len(diffs) == 1 and shape0[diffs[0]] * len(ranks) == other_shape[diffs[0]]:
            d = diffs[0]
            return Full(_concat(by_rank, ranks, d), f"cat dim {d} × {len(ranks)} ranks",
                        "inferred: shape × tp = the other side's", tdim)
    first = _tensor(by_rank[ranks[0]])
    odd = []
    for r in ranks[1:]:
        if measure(_tensor(by_rank[r]), first)["level"] not in ("bitwise", "noise"):
            odd.append(r)
    if lay:      # declared replicated: the first rank is the value; ranks that differ are named
        total = sum_over(by_rank, ranks, tdim, masks=False)[0] if odd else None
        return Full(first, f"rank {ranks[0]} (replicated)", "dims", tdim, odd_ranks=odd, sum_all=total)
    if not odd:
        return Full(first, f"rank {ranks[0]} (replicated)", "inferred: ranks equal", tdim)
    # no dims, and the ranks differ: summed to compare, but a partial sum is never passed off as a
    # match (`tpprobe report` names such a record partial-allreduce): every rank is an odd one
    total = sum_over(by_rank, ranks, tdim, masks=False)[0]
    # the first rank's value is kept too: where it, not the sum, equals the other side, the record is a replica
    # on which some ranks diverged (_diff_one decides; summing such a record doubles every value)
    return Full(total, f"Σ {len(ranks)} ranks", "inferred: ranks differ", tdim, odd_ranks=list(ranks), sum_all=total,
                replica=(first, ranks[0], odd))


def _tensor(f: DumpFile) -> torch.Tensor:
    v, _ = load(f)
    if not isinstance(v, torch.Tensor):
        raise CaptureError(f"{f.path}: its value is a {type(v).__name__}, not a tensor; tpprobe diff compares tensors")
    return v


def _concat(by_rank, ranks, dim: int) -> torch.Tensor:
    """The shards in tp_rank order, concatenated on dim, copied into the result one at a time."""
    out, at = None, 0
    order = _tp_order(by_rank, ranks)
    for i, r in enumerate(order):
        x = _tensor(by_rank[r])
        if out is None:
            shape = list(x.shape)
            shape[dim] *= len(order)
            out = torch.empty(shape, dtype=x.dtype)
        if x.shape[dim] * len(order) != out.shape[dim] or x.dtype != out.dtype:
            raise CaptureError(f"{by_rank[r].path}: shard shape {list(x.shape)} {x.dtype} differs from tp rank "
                               f"{order[0]}'s; expected equal shards to concatenate on dim {dim}")
        out.narrow(dim, at, x.shape[dim]).copy_(x)
        at += x.shape[dim]
        del x
    return out


def _tp_order(by_rank, ranks) -> list:
    """Ranks in tp_rank order (the order shards concatenate in)."""
    return sorted(ranks, key=lambda r: tp_of(peek(by_rank[r])[1], by_rank[r])[0])



def _ids_by_step(run: DumpRun) -> dict[int, torch.Tensor]:
    out = {}
    for (name, tags, step), by_rank in run.groups.items():
        if (name == "input_ids" or name.endswith("input_ids")) and not tags:
            v, _ = load(by_rank[min(by_rank)])
            if isinstance(v, torch.Tensor):
                out[step] = v.reshape(-1).long()
    return out


def diff_data(bpath, tpath) -> dict:
    with one_thread():
        return _diff_data(bpath, tpath)


def _diff_data(bpath, tpath) -> dict:
    b, t = scan(bpath), scan(tpath)
    bids, tids = _ids_by_step(b), _ids_by_step(t)
    names_b, names_t = b.names(), t.names()
    common = [n for n in names_b if n in names_t]
    rows, notes = [], []
    same_steps = [s for s in b.steps if s in t.steps]
    per_step = (bids.keys() == tids.keys() and all(torch.equal(bids[s], tids[s]) for s in bids)) or (not bids
                                                                                                     or not tids)
    if not per_step:
        bseq = torch.cat([bids[s] for s in sorted(bids)])
        tseq = torch.cat([tids[s] for s in sorted(tids)])
        n = min(bseq.numel(), tseq.numel())
        if not torch.equal(bseq[:n], tseq[:n]):
            k = int((bseq[:n] != tseq[:n]).nonzero()[0, 0])
            raise UsageError(f"the two runs ran different tokens: baseline token {k} is id {int(bseq[k])}, target's is "
                             f"id {int(tseq[k])} (input_ids concatenated over steps); refusing to compare different "
                             f"sequences")
        notes.append(f"tokens aligned by input_ids: the runs batch differently (baseline steps "
                     f"{[int(bids[s].numel()) for s in sorted(bids)]}, target steps "
                     f"{[int(tids[s].numel()) for s in sorted(tids)]} "
                     f"tokens); {n} tokens compared, records concatenated over steps on their token dim")
    elif not bids or not tids:
        notes.append("no input_ids record on " + ("either side" if not bids and not tids else
                                                  "the baseline" if not bids else "the target")
                     + ": tokens aligned by step and position, not checked")
    else:
        notes.append(f"input_ids identical at every step ({sum(int(v.numel()) for v in bids.values())} tokens)")
    for name, tags in common:
        if name.endswith("input_ids") and not tags:
            continue
        bkeys = [(name, tags, s) for s in b.steps if (name, tags, s) in b.groups]
        tkeys = [(name, tags, s) for s in t.steps if (name, tags, s) in t.groups]
        if per_step:
            for s in same_steps:
                bk, tk = (name, tags, s), (name, tags, s)
                if bk in b.groups and tk in t.groups:
                    rows.append(_diff_one(b, t, [bk], [tk], name, tags, str(s), None))
        else:
            rows.append(_diff_one(b, t, bkeys, tkeys, name, tags, "all", n))
    only_b = [n for n in names_b if n not in names_t]
    only_t = [n for n in names_t if n not in names_b]
    bad = [r for r in rows if r["level"] in ("material", "shape")
           and not any(o["sum_matches"] for o in r["odd"].values())]
    findings = []
    for r in bad:
        findings.append(Finding("reference-mismatch", f"{r['name']} (step {r['step']})", r.get("target_ranks", []),
                                detail=f"target differs from the baseline ({r['level']}: max abs diff "
                                       f"{r.get('max_abs') or 0:.3g}, rel diff "
                                       f"{rel_l2(r.get('rel_diff') or 0):.3g}, first "
                                       f"token "
                                       f"{r.get('first_token')}); baseline {r['baseline_how']}, target "
                                       f"{r['target_how']}",
                                evidence={"all_ranks": True}).to_json())
    for r in rows:
        for side, o in r["odd"].items():
            other = "target" if side == "baseline" else "baseline"
            if o["sum_matches"] and not o.get("declared", True):
                findings.append(Finding("partial-allreduce", f"{r['name']} (step {r['step']}, {side})", o["all_ranks"],
                                        detail=f"no dims say how it is split over tp and its ranks differ: it was "
                                               f"summed "
                                               f"over the {side}'s ranks to compare, and that sum equals the {other}, "
                                               f"so "
                                               f"each rank holds a partial sum (its all-reduce had not run; if the "
                                               f"record "
                                               f"is meant partial, its dims should say so: h[tp:partial]), as `tpprobe "
                                               f"report` names it",
                                               evidence={"all_ranks": True, "summed": "inferred"}).to_json())
            elif not o.get("declared", True):
                continue     # summed by inference and still different: the reference-mismatch above says it
            elif o["sum_matches"]:
                findings.append(Finding("partial-allreduce", f"{r['name']} (step {r['step']}, {side})", o["all_ranks"],
                                        detail=f"{o.get('by', 'its dims declare it replicated')}, but "
                                               f"{rank_words(o['ranks'])} {differs(o['ranks'])} from the first "
                                               f"and Σ over the {side}'s ranks equals the {other}: each rank holds a "
                                               f"partial "
                                               f"sum (its all-reduce had not run)",
                                               evidence={"all_ranks": True}).to_json())
            else:
                findings.append(Finding("rank-divergence", f"{r['name']} (step {r['step']}, {side})", o["ranks"],
                                        detail=f"{o.get('by', 'its dims declare it replicated')}, but "
                                               f"{rank_words(o['ranks'])} {differs(o['ranks'])} "
                                               f"materially from the first (and Σ over ranks does not equal the "
                                               f"{other})", evidence={"explain": DUMP_DIVERGENCE}).to_json())
    for side, only in (("baseline", only_b), ("target", only_t)):
        if only:
            findings.append(Finding("missing-capture", ", ".join(n for n, _ in only[:6]), [], severity=WARNING,
                                    detail=f"{len(only)} names only in the {side}: not compared",
                                    evidence={"all_ranks": True}).to_json())
    if not rows:
        raise UsageError(f"no tensor name is in both runs ({len(names_b)} in the baseline, {len(names_t)} in the "
                         f"target): nothing to compare")
    return {"schema": SCHEMA_DIFF, "baseline": str(b.path), "target": str(t.path), "notes": notes, "rows": rows,
            "findings": findings, "exit_code": exit_code(findings)}


def _replica_if_it_matches(mine: "Full", other: "Full") -> None:
    """A record with no dims whose ranks differ is summed; where the first rank's value, not that sum, equals
    the other side, it is a replica on which some ranks diverged: that value is compared, those ranks named."""
    ok = ("bitwise", "noise")
    if mine.replica is None or mine.replica[0].shape != other.value.shape:
        return
    value, first, odd = mine.replica
    if measure(mine.value, other.value)["level"] not in ok and measure(value, other.value)["level"] in ok:
        mine.value, mine.how, mine.source, mine.odd_ranks = value, f"rank {first} (replicated)", REPLICA, odd


def _cat(run, keys, other_shape, n_tokens):
    fulls = [unshard(run, k, other_shape) for k in keys]
    f0 = fulls[0]
    v = torch.cat([f.value for f in fulls], dim=f0.tdim) if len(fulls) > 1 else f0.value
    if n_tokens is not None:
        v = v.narrow(f0.tdim, 0, min(n_tokens, v.shape[f0.tdim]))
    odd = sorted({r for f in fulls for r in f.odd_ranks})
    total = None
    if odd:
        total = torch.cat([f.sum_all if f.sum_all is not None else f.value for f in fulls], dim=f0.tdim)
        if n_tokens is not None:
            total = total.narrow(f0.tdim, 0, min(n_tokens, total.shape[f0.tdim]))
    replica = None
    if all(f.replica is not None for f in fulls):
        rv = torch.cat([f.replica[0] for f in fulls], dim=f0.tdim) if len(fulls) > 1 else f0.replica[0]
        if n_tokens is not None:
            rv = rv.narrow(f0.tdim, 0, min(n_tokens, rv.shape[f0.tdim]))
        replica = (rv, f0.replica[1], sorted({r for f in fulls for r in f.replica[2]}))
    return Full(v, f0.how, f0.source, f0.tdim, odd_ranks=odd, sum_all=total, replica=replica)


def _diff_one(b, t, bkeys, tkeys, name, tags, step, n_tokens) -> dict:
    # a target with one file per record gives the full shape the baseline's shards must add up to
    tgroup = t.groups[tkeys[0]]
    tshape = peek(tgroup[min(tgroup)])[0] if len(tgroup) == 1 else None
    bfull = _cat(b, bkeys, tshape, n_tokens)
    tfull = _cat(t, tkeys, tuple(bfull.value.shape), n_tokens)
    for mine, other in ((tfull, bfull), (bfull, tfull)):
        _replica_if_it_matches(mine, other)
    s = measure(tfull.value, bfull.value)
    odd = {}
    for side, mine, other in (("baseline", bfull, tfull), ("target", tfull, bfull)):
        if mine.odd_ranks:
            m = measure(mine.sum_all, other.value)["level"] if mine.sum_all is not None else "shape"
            run, keys = (b, bkeys) if side == "baseline" else (t, tkeys)
            odd[side] = {"ranks": mine.odd_ranks, "all_ranks": sorted(run.groups[keys[0]]),
                         "sum_matches": m in ("bitwise", "noise"), "declared": mine.source in ("dims", REPLICA),
                         "by": "its dims declare it replicated" if mine.source != REPLICA else
                         f"it is a replica (no dims; rank {mine.replica[1]} equals the "
                         f"{'target' if side == 'baseline' else 'baseline'})"}
    row = {"odd": odd, "name": name + "".join(f" {k}={v}" for k, v in tags), "step": step,
           "baseline_how": f"{bfull.how} [{bfull.source}]", "target_how": f"{tfull.how} [{tfull.source}]",
           "inferred": [side for side,
                        f in (("baseline", bfull), ("target", tfull)) if f.source.startswith("inferred")],
           "shape": list(tfull.value.shape), "dtype": str(tfull.value.dtype).replace("torch.", ""),
           "target_ranks": sorted(t.groups[tkeys[0]]), **s}
    return row
