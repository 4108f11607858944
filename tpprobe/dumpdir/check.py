"""One dumper folder checked across ranks: every record's ranks against the first, shares and partial sums named.

`tpprobe report DUMPDIR`'s data: per record (name, tags, step) the reading (replicated, partial,
sharded, divergent, mismatch), per-rank levels, and findings merged over steps.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .measure import bitwise, flat, measure, nonfinite_count, one_thread, rows_nonzero
from ..checks.crossrank import classes as rank_classes
from ..checks.findings import INFO, SEVERITIES, WARNING, Finding, exit_code
from ..core.noise import rel_l2
from ..formats.sglang_dump import DumpRun, load, scan, token_dim, tp_layout, tp_of

SCHEMA_REPORT = "tpprobe.dumper-report/1"

# divergence never blames a weight shard (tpprobe probe reads both)
DUMP_DIVERGENCE = ("one rank's tensor differs materially from the others': a rank-dependent code path, a collective "
                   "that ran wrong, or a weight loaded differently; the dump holds no parameters or collective "
                   "records to tell which (tpprobe probe compares the replicated parameters and audits every reduce)")


# ---- one run: cross-rank checks --------------------------------------------------------------------
@dataclass
class GroupResult:
    name: str
    tags: tuple
    step: int
    shape: list
    dtype: str
    tp_size: int
    tp_source: str
    declared: Optional[str]
    read: str                       # replicated | partial | sharded | divergent | mismatch | single
    per_rank: dict
    findings: list = field(default_factory=list)
    sharded_dim: Optional[int] = None
    evidence: dict = field(default_factory=dict)


def rank_words(ranks) -> str:
    """`rank 1` for one rank, `ranks [1, 2]` for several (as a finding's line names them)."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def differs(ranks) -> str:
    """The verb after rank_words: `rank 1 differs`, `ranks [1, 2] differ`."""
    return "differs" if len(list(ranks)) == 1 else "differ"


def _where(g: GroupResult) -> str:
    extra = "".join(f" {k}={v}" for k, v in g.tags)
    return f"{g.name}{extra} (step {g.step})"


def check_run(run: DumpRun) -> dict:
    """Cross-rank checks on every group of one dumper run; the findings, per-group readings, coverage."""
    results: list[GroupResult] = []
    replicated_refs: list[tuple] = []   # (step, shape, dtype, file, name) of replicated records (Σ candidates)
    pending: list[tuple] = []           # groups whose ranks differ without a declaration: judged after the scan
    widths: Counter = Counter()
    tp_ranks: dict = {}                 # global rank -> its tp rank, as its files' meta say
    records = 0
    ref = None
    for (name, tags, step), by_rank in sorted(run.groups.items(),
                                              key=lambda kv: (kv[0][2], min(f.dump_index for f in kv[1].values()))):
        ranks = sorted(by_rank)
        ref_r = ranks[0]
        ref = None           # the previous group's record goes before this one is read
        ref, meta = load(by_rank[ref_r])
        records += 1
        tp_rank, tp_size, src = tp_of(meta, by_rank[ref_r])
        tp_ranks.setdefault(ref_r, tp_rank)
        dims = meta.get("dims")
        lay = tp_layout(dims)
        is_t = isinstance(ref, torch.Tensor)
        g = GroupResult(name, tags, step, list(ref.shape) if is_t else [],
                        str(ref.dtype).replace("torch.", "") if is_t else
                        type(ref).__name__, tp_size, src, dims if isinstance(dims, str) else None, "single",
                        {str(ref_r): {"level": "reference"}})
        results.append(g)
        if not is_t:
            g.read = "not a tensor"
            continue
        missing = [r for r in run.ranks if r not in by_rank]
        if missing:
            g.findings.append(Finding("capture-file", _where(g), missing,
                                      detail=f"{rank_words(missing)} {'has' if len(missing) == 1 else 'have'} no "
                                             f"file for this record while {rank_words(ranks)} "
                                             f"{'does' if len(ranks) == 1 else 'do'} (a rank-dependent dump or a lost "
                                             f"file)"))
        nf = nonfinite_count(ref)
        quick = bool(lay and lay[0] in ("partial", "sharded") and tp_size > 1)
        for r in ranks[1:]:
            x, m = load(by_rank[r])
            records += 1
            tp_ranks.setdefault(r, tp_of(m, by_rank[r])[0])
            if not isinstance(x, torch.Tensor):
                s = {"level": "shape", "shape": type(x).__name__}
            elif quick:      # declared shards: only "is it a copy?" matters (a dims-mismatch), not the numbers
                s = ({"level": "shape", "shape": list(x.shape)} if x.dim() != ref.dim() else
                     {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0} if bitwise(x, ref)
                     else {"level": "material"})
            else:
                s = measure(x, ref)
            if s["level"] == "material" and isinstance(x, torch.Tensor):
                s["nonfinite"] = nonfinite_count(x)
            g.per_rank[str(r)] = s
            del x
        if nf:
            g.per_rank[str(ref_r)]["nonfinite"] = nf
        if len(ranks) == 1:      # nothing to compare it with: its own values are still checked
            if nf:
                g.findings.append(Finding("non-finite", _where(g), ranks,
                                          detail=f"{nf} NaN/Inf values on {rank_words(ranks)}, the one rank that "
                                                 f"dumped it"))
            continue
        levels = {r: g.per_rank[str(r)]["level"] for r in ranks[1:]}
        odd = [r for r, lv in levels.items() if lv in ("material", "shape")]
        if ref.dim() >= 2 and (lay is None or lay[0] != "sharded"):
            widths[int(ref.shape[-1])] += 1
        if not odd:
            if lay and lay[0] in ("partial", "sharded") and tp_size > 1 \
                    and all(v == "bitwise" for v in levels.values()) and bool(flat(ref).ne(0).any()):
                g.read = "replicated"
                would = 'sum it ' + str(tp_size) + ' times' if lay[0] == 'partial' else 'concatenate copies'
                g.findings.append(Finding("dims-mismatch", _where(g), ranks, severity=WARNING,
                                          detail=f"dims {dims!r} declare it {lay[0]} over tp, but every rank holds the "
                                                 f"same values: it is replicated (already reduced or gathered); "
                                                 f"SGLang's comparator would {would}",
                                          evidence={"all_ranks": True}))
            else:
                g.read = "replicated"
                replicated_refs.append((step, tuple(ref.shape), ref.dtype, by_rank[ref_r], name))
            if nf:
                g.findings.append(Finding("non-finite", _where(g), ranks, detail=f"{nf} NaN/Inf values on every rank",
                                          evidence={"all_ranks": True}))
            continue
        if any(levels[r] == "shape" for r in odd):
            shapes = {r: g.per_rank[str(r)].get("shape") for r in odd}
            g.read = "mismatch"
            g.findings.append(Finding("capture-mismatch", _where(g), odd,
                                      detail=f"rank {ref_r} dumped shape {list(ref.shape)} {g.dtype}, "
                                             f"{rank_words(odd)} {shapes[odd[0]] if len(odd) == 1 else shapes} "
                                             f"(a rank-dependent dump)"))
            continue
        nf_ranks = [r for r in odd if g.per_rank[str(r)].get("nonfinite")] + ([ref_r] if nf else [])
        if nf_ranks:
            g.read = "divergent"
            g.findings.append(Finding("non-finite", _where(g), sorted(nf_ranks),
                                      detail=f"NaN/Inf values on {rank_words(sorted(nf_ranks))} only"))
            continue
        if lay and lay[0] in ("partial", "sharded"):
            _shares(g, ranks, lay[0], {"declared": True})
            g.sharded_dim = lay[1] if lay[0] == "sharded" else None
            continue
        pending.append((g, by_rank, ref_r, ranks, odd, lay))
        del ref
    hidden = widths.most_common(1)[0][0] if widths else None
    for g, by_rank, ref_r, ranks, odd, lay in pending:
        _diagnose_differing(g, by_rank, ref_r, ranks, odd, lay, hidden, replicated_refs)
    return {"groups": results, "records": records, "hidden": hidden, "tp_ranks": tp_ranks}


class RankFiles:
    """One record's rank files as the evidence checks/crossrank.classes groups ranks by: two ranks are the
    same when measure() (the one noise rule) calls them bitwise or noise. A rank against the reference
    rank is read off the levels already measured; any other pair loads two records at a time."""

    def __init__(self, by_rank: dict, ref_r: int, per_rank: dict):
        self.by_rank, self.ref_r, self.per_rank = by_rank, ref_r, per_rank

    def same(self, name: str, r: int, q: int) -> bool:
        if q == self.ref_r and r != q and str(r) in self.per_rank:
            level = self.per_rank[str(r)]["level"]
        else:
            level = measure(load(self.by_rank[r])[0], load(self.by_rank[q])[0])["level"]
        return level in ("bitwise", "noise")


def sum_over(by_rank, ranks, tdim: int = 0, masks: bool = True):
    """Σ over ranks (rounded once to the dtype: two ranks are added directly, more accumulate in float32)
    and, with masks, each rank's non-zero token rows."""
    rows: dict = {}
    if len(ranks) == 2 and not masks:
        x0, x1 = load(by_rank[ranks[0]])[0], load(by_rank[ranks[1]])[0]
        if x0.dtype == x1.dtype and x0.shape == x1.shape and x0.dtype.is_floating_point:
            return x0 + x1, rows
    acc, dtype = None, None
    for r in ranks:
        x, _ = load(by_rank[r])
        if masks:
            rows[r] = rows_nonzero(x, tdim) if x.dim() >= 1 else None
        dtype = x.dtype
        acc = x.float().clone() if acc is None else acc.add_(x.float())
        del x
    return acc.to(dtype), rows


def _diagnose_differing(g: GroupResult, by_rank, ref_r, ranks, odd, lay, hidden, replicated_refs) -> None:
    world = len(ranks)
    where = _where(g)
    declared = f" (its dims declare it replicated: {g.declared!r})" if lay and lay[0] == "replicated" else ""
    classes = rank_classes(RankFiles(by_rank, ref_r, g.per_rank), g.name, ranks)   # ref_r is ranks[0]
    if len(classes[0]) * 2 > world:
        bad = sorted(r for c in classes[1:] for r in c)
        _divergent(g, bad, g.per_rank.get(str(bad[0]), {}) if classes[0][0] == ref_r else {},
                   f"the {len(classes[0])} ranks that agree", "", declared, classes)
        return
    tdim = token_dim(g.declared)
    total, masks = sum_over(by_rank, ranks, tdim)
    ev: dict = {"groups": classes, "all_ranks": True}
    if all(m is not None for m in masks.values()) and len(masks) > 1:
        m = torch.stack([masks[r] for r in ranks])
        any_nz = m.any(0)
        one = (m.sum(0) == 1) & any_nz
        n_any = int(any_nz.sum())
        holders = int((m & one).any(1).sum())
        frac = int(one.sum()) / n_any if n_any else 0.0
        ev.update(rows_nonzero_on_one_rank=frac, token_rows=int(m.shape[1]), ranks_holding_rows=holders)
        if n_any and frac >= 0.9 and holders >= 2:
            _shares(g, ranks, "partial", ev)
            match = _sum_matches(total, g.step, replicated_refs, g.name)
            g.findings.append(Finding("partial-allreduce", where, list(ranks),
                                      detail=f"each rank holds its own partial sum: {frac:.0%} of the {n_any} non-zero "
                                             f"token "
                                             f"rows are non-zero on exactly one rank (disjoint vocab rows: a "
                                             f"vocab-parallel "
                                             f"embedding before its all-reduce); Σ over ranks is the value"
                                             + (f" and equals {match}" if match else "") + declared,
                                      evidence={**ev, **({"sum_equals": match} if match else {})}))
            return
    match = _sum_matches(total, g.step, replicated_refs, g.name)
    if match:
        _shares(g, ranks, "partial", {**ev, "sum_equals": match})
        g.findings.append(Finding("partial-allreduce", where, list(ranks),
                                  detail=f"each rank holds a partial sum: Σ over the {world} ranks equals {match} "
                                         f"(within rounding); its all-reduce had not run{declared}",
                                  evidence=g.evidence))
        return
    width = g.shape[-1] if g.shape else None
    if hidden and width and width * world == hidden and len(g.shape) >= 2:
        _shares(g, ranks, "sharded")
        g.sharded_dim = len(g.shape) - 1
        g.findings.append(Finding("tp-sliced", where, list(ranks), severity=WARNING,
                                  detail=f"width {width} = {hidden} / tp {world} and the ranks hold different values: "
                                         f"each "
                                         f"rank dumped its TP slice of a {hidden}-wide tensor, and no dims say so "
                                         f"(annotate h[tp], or dump it after the gather){declared}",
                                  evidence={"hidden": hidden, **ev}))
        return
    stats = [g.per_rank[str(r)] for r in ranks if r != ref_r]
    if stats and all((s.get("rel_diff") or 0) >= 0.01 and (s.get("bad_fraction") or 0) >= 0.5 for s in stats):
        _shares(g, ranks, "partial", {**ev, "proof": "none (no replicated record equals the sum)"})
        g.findings.append(Finding("partial-allreduce", where, list(ranks),
                                  detail=f"every rank holds different values over "
                                         f"{min(s['bad_fraction'] for s in stats):.0%}+ "
                                         f"of the elements (rel diff ≥ "
                                         f"{rel_l2(min(s['rel_diff'] for s in stats)):.2g}): a "
                                         f"partial sum "
                                         f"(Σ over ranks is the value; annotate h[tp:partial] if that is intended) or "
                                         f"a "
                                         f"rank-dependent tensor; no replicated record of this step equals the "
                                         f"sum{declared}",
                                  evidence=g.evidence))
        return
    bad = [r for r in ranks if r != ref_r]
    _divergent(g, bad, g.per_rank[str(bad[0])], f"rank {ref_r}",
               f"; with {world} ranks and no majority, rank {ref_r} is taken as the reference", declared, classes)


def _divergent(g: GroupResult, bad, s: dict, against: str, note: str, declared: str, classes) -> None:
    g.read = "divergent"
    g.findings.append(Finding("rank-divergence", _where(g), bad,
                              detail=f"{rank_words(bad)} {differs(bad)} materially "
                                     f"from {against} (max abs diff {s.get('max_abs', 0) or 0:.3g}, rel diff "
                                      f"{rel_l2(s.get('rel_diff', 0) or 0):.3g}, first token "
                                      f"{s.get('first_token')}){note}{declared}",
                              evidence={"groups": classes, "explain": DUMP_DIVERGENCE}))


def _shares(g: GroupResult, ranks, read: str, evidence: Optional[dict] = None) -> None:
    """Every rank holds its own share (a partial or a slice): no rank is 'wrong'."""
    g.read = read
    if evidence is not None:
        g.evidence = evidence
    for r in ranks:
        g.per_rank[str(r)] = {**g.per_rank[str(r)], "level": "share"}


def _sum_matches(total, step, replicated_refs, name) -> Optional[str]:
    for st, shape, dtype, f, other in replicated_refs:
        if st == step and shape == tuple(total.shape) and other != name:
            y, _ = load(f)
            if y.dtype == total.dtype and measure(total, y)["level"] in ("bitwise", "noise"):
                return other
    return None


# ---- report ------------------------------------------------------------------------------------------
def _merge_findings(groups: list[GroupResult]) -> list[dict]:
    """One finding per (kind, name, ranks) over steps: 'embed (steps 0-3)'."""
    merged: dict = {}
    for g in groups:
        for f in g.findings:
            key = (f.kind, g.name, g.tags, tuple(f.ranks), f.severity)
            if key in merged:
                merged[key][1].append(g.step)
            else:
                merged[key] = (f, [g.step])
    out = []
    for (kind, name, tags, ranks, sev), (f, steps) in merged.items():
        if len(steps) > 1:
            extra = "".join(f" {k}={v}" for k, v in tags)
            f.where = f"{name}{extra} (steps {span(steps)})"
        f.evidence = {**f.evidence, "steps": steps}
        out.append(f.to_json())
    return sorted(out, key=lambda d: SEVERITIES.index(d["severity"]))


def span(steps) -> str:
    s = sorted(set(steps))
    return f"{s[0]}-{s[-1]}" if len(s) > 2 and s == list(range(s[0], s[-1] + 1)) else ", ".join(map(str, s))


def report_data(path) -> dict:
    run = scan(path)
    with one_thread():
        res = check_run(run)
    groups: list[GroupResult] = res["groups"]
    findings = _merge_findings(groups)
    noisy = [g for g in groups if g.read == "replicated"
             and any(s.get("level") == "noise" for s in g.per_rank.values())]
    if noisy:
        worst = max(s.get("ulp_max", 0) or 0 for g in noisy for s in g.per_rank.values())
        names = sorted({g.name for g in noisy})
        findings.append(Finding("rounding-noise", ", ".join(names[:6]) + (" …" if len(names) > 6 else ""),
                                sorted({int(r) for g in noisy for r,
                                        s in g.per_rank.items() if s.get("level") == "noise"}),
                                severity=INFO, detail=f"{len(noisy)} records differ across ranks by rounding only "
                                                      f"(max {worst:g} ULP): not a failure").to_json())
    tps = Counter(g.tp_size for g in groups)
    tp_size = tps.most_common(1)[0][0] if tps else 1
    whole = _missing_ranks(run.ranks, res["tp_ranks"], tp_size)
    if whole is not None:
        # a whole rank's files are not in the folder: its records were never compared, so nothing here is
        # HEALTHY across ranks
        findings.insert(0, whole.to_json())
    return {"schema": SCHEMA_REPORT, "path": str(run.path), "ranks": run.ranks, "steps": run.steps, "tp_size": tp_size,
            "tp_source": groups[0].tp_source if groups else None, "hidden": res["hidden"],
            "coverage": {"files": len(run.files), "records_read": res["records"], "groups": len(groups),
                         "names": len(run.names()),
                         "checked": sum(1 for g in groups if g.read != "not a tensor"),
                         # the tensor records held by two or more ranks: the ones compared across ranks
                         "across_ranks": sum(1 for g in groups if g.read != "not a tensor" and len(g.per_rank) > 1),
                         "not_tensors": [_where(g) for g in groups if g.read == "not a tensor"]},
            "records": [_group_json(g) for g in groups], "findings": findings, "exit_code": exit_code(findings),
            "_groups": groups}


def _missing_ranks(ranks: list, tp_ranks: dict, tp_size: int) -> Optional[Finding]:
    """The tp ranks of a tp group with no file in the folder, named by the tp rank the files' meta give (a
    folder of a second tp group holds global ranks tp..2tp-1) and, where the present files agree on one
    offset between global and tp rank, by the global rank that would have written them."""
    have = {tp_ranks.get(r, r) for r in ranks}
    absent = sorted(set(range(tp_size)) - have)
    if not absent:
        return None
    offsets = {r - tp_ranks.get(r, r) for r in ranks}
    named = [offsets.pop() + t for t in absent] if len(offsets) == 1 else absent
    held = rank_words(ranks) if all(tp_ranks.get(r, r) == r for r in ranks) else \
        f"{rank_words(ranks)} (tp {rank_words(sorted(have))})"
    lost = rank_words(named) if named == absent else f"{rank_words(named)} (tp {rank_words(absent)})"
    one = len(named) == 1
    return Finding("capture-file", "the whole dump", named,
                   detail=f"the records declare tp {tp_size} but the folder holds files of {held} only: "
                          f"{lost} {'is' if one else 'are'} missing (not copied, or {'its' if one else 'their'} "
                          f"dumper never wrote); no record was compared with {'it' if one else 'them'}")


def _group_json(g: GroupResult) -> dict:
    return {"name": g.name, "tags": dict(g.tags), "step": g.step, "shape": g.shape, "dtype": g.dtype,
            "tp_size": g.tp_size, "declared_dims": g.declared, "read": g.read, "sharded_dim": g.sharded_dim,
            "per_rank": g.per_rank, "evidence": {k: v for k, v in g.evidence.items() if k != "groups"}}
