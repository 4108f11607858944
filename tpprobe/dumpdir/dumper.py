"""SGLang's dumper folders: `tpprobe report DUMPDIR`, `tpprobe diff B T` and `--emit-dims`.

The format (`sglang.srt.debug_utils.dumper`): one `torch.save` file per tensor per rank per call,
named `step=S___rank=R___dump_index=I___name=N___<tag>=<v>….pt`, holding
`{"value": tensor, "meta": {filename keys, world_rank, world_size, sglang_parallel_info (tp_rank,
tp_size, …), dims (when the caller gave them), …}}`. A folder is a dumper folder when its `.pt`
files carry step, rank and name in their names (or it has exactly one such subfolder, as SGLang's
comparator accepts).

Loading is safe and streamed: `torch.load(weights_only=True)`, one file at a time, memory-mapped
(`mmap=True`: the values are read from the page cache where they are used, not copied first;
a file that cannot be mapped is read whole); a group (one name, step and tag set) holds the
reference rank's record and one other record at a time, so memory is bounded by two records, not
the folder.

Numbers: every comparison goes through tpprobe's one noise rule (tpprobe/core/noise.py): its fast
path `fast_level()` decides bitwise equality (a memcmp) and proves rounding noise from the bits in
chunks of token rows (same dtype; every element finite, of one sign and within ulp_bound
representable steps; rel_norm and the worst row below their bounds with a rounding margin);
anything it cannot show is judged by `compare()` itself, over chunks of token rows (its tensor
scale then is the chunk's RMS).
"""
from __future__ import annotations

import json
import re
import sys
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..core.noise import INT_VIEW, coarser, compare, fast_level, has_nonfinite   # THE noise rule
from ..core.errors import CaptureError, UsageError
from ..checks.findings import FAILURE, INFO, WARNING, Finding, exit_code

SCHEMA_REPORT = "tpprobe.dumper-report/1"
SCHEMA_DIFF = "tpprobe.dumper-diff/1"
REQUIRED_KEYS = ("step", "rank", "name")
# filename keys that are not part of a record's identity across ranks
NON_IDENTITY = {"step", "rank", "dump_index", "name", "recompute_status",
                "pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"}
EXPECTED = ("an SGLang dumper folder (files step=S___rank=R___dump_index=I___name=N….pt written by "
            "sglang.srt.debug_utils.dumper, or a folder holding exactly one such folder)")
COMPARE_CHUNK = 1 << 20   # elements per compare() call on the slow path
LEVEL_ORDER = ["reference", "share", "bitwise", "noise", "material", "shape"]


# ---- the folder ----------------------------------------------------------------------------------
def parse_name(fname: str) -> Optional[dict]:
    """The key=value tags of a dumper file name, or None when it is not one."""
    if not fname.endswith(".pt"):
        return None
    tags: dict = {}
    for part in fname[:-3].split("___"):
        k, sep, v = part.partition("=")
        if not sep or not k:
            return None
        tags[k] = v
    if not all(k in tags for k in REQUIRED_KEYS):
        return None
    try:
        tags["step"], tags["rank"] = int(tags["step"]), int(tags["rank"])
        tags["dump_index"] = int(tags.get("dump_index", 0))
    except ValueError:
        return None
    return tags


# a dump holds no parameters and no collective audit: it cannot tell a weight from a code path, so its
# divergence never blames a weight shard (tpprobe probe reads both)
DUMP_DIVERGENCE = ("one rank's tensor differs materially from the others': a rank-dependent code path, a collective "
                   "that ran wrong, or a weight loaded differently; the dump holds no parameters or collective "
                   "records to tell which (tpprobe probe compares the replicated parameters and audits every reduce)")


def _dump_files(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_file() and parse_name(p.name) is not None]
    except OSError:
        return []


def find_dump_dir(path) -> Optional[Path]:
    """The folder holding the dumper files: `path` itself, or its one dumper subfolder."""
    path = Path(path)
    if not path.is_dir():
        return None
    if _dump_files(path):
        return path
    subs = [d for d in sorted(path.iterdir()) if d.is_dir() and _dump_files(d)]
    return subs[0] if len(subs) == 1 else None


def is_dumper_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and not (p / "manifest.json").exists() and find_dump_dir(p) is not None


@dataclass
class DumpFile:
    path: Path
    step: int
    rank: int
    name: str
    dump_index: int
    tags: tuple          # identity tags other than name/step/rank

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.tags if not k.startswith("#"))
        return self.name + extra


@dataclass
class DumpRun:
    path: Path
    files: list[DumpFile]
    groups: dict = field(default_factory=dict)   # (name, tags, step) -> {rank: DumpFile}
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    def names(self) -> list[tuple]:
        seen: dict = {}
        for (name, tags, _s) in self.groups:
            seen.setdefault((name, tags), None)
        return list(seen)


def scan(path, role: str = "") -> DumpRun:
    """Every dumper file of one run, grouped by (name, tags, step) then rank. Reads names only."""
    p = Path(path)
    if not p.exists():
        raise CaptureError(f"{p}: no such folder; expected {EXPECTED}")
    d = find_dump_dir(p)
    if d is None:
        if p.is_dir() and (p / "manifest.json").exists():
            raise CaptureError(f"{p}: a tpprobe capture folder, not an SGLang dumper folder")
        subs = [s.name for s in sorted(p.iterdir()) if s.is_dir() and _dump_files(s)] if p.is_dir() else []
        if len(subs) > 1:
            raise UsageError(f"{p}: holds {len(subs)} dumper runs ({', '.join(subs[:4])}); pass one of them")
        raise CaptureError(f"{p}: no dumper files in it; expected {EXPECTED}")
    files = []
    for fp in _dump_files(d):
        t = parse_name(fp.name)
        ident = tuple(sorted((k, v) for k, v in t.items() if k not in NON_IDENTITY))
        files.append(DumpFile(fp, t["step"], t["rank"], t["name"], t["dump_index"], ident))
    files.sort(key=lambda f: (f.rank, f.step, f.dump_index))
    run = DumpRun(d, files)
    # the k-th dump of the same name and tags in one step on one rank is its own record (#k)
    occ: Counter = Counter()
    for f in files:
        key = (f.name, f.tags, f.step, f.rank)
        k = occ[key]
        occ[key] += 1
        if k:
            f.tags = f.tags + (("#", str(k)),)
        run.groups.setdefault((f.name, f.tags, f.step), {})[f.rank] = f
    run.ranks = sorted({f.rank for f in files})
    run.steps = sorted({f.step for f in files})
    return run


def load(f: DumpFile) -> tuple:
    """(value, meta) of one dumper file, loaded without executing code."""
    path = f.path if isinstance(f, DumpFile) else Path(f)
    import pickle
    import zipfile
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:       # mapped: the bytes are read where they are compared, not copied first
                data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                raise
            except Exception:      # not mappable (an old format, a pipe): read it whole; its errors are said below
                data = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CaptureError(f"{path}: refused: it holds pickled objects other than tensors and plain containers, "
                           f"which only an unsafe load would build (torch.load weights_only=True: {first[:140]}); "
                           f"expected a dumper file holding {{'value': tensor, 'meta': dict}}")
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, KeyError, AttributeError,
            TypeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CaptureError(f"{path}: not a readable torch.save file ({first[:140]}); re-dump it or remove it")
    if not isinstance(data, dict) or "value" not in data or not isinstance(data.get("meta", {}), dict):
        what = f"a dict with keys {list(data)[:6]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise CaptureError(f"{path}: holds {what}; expected a dumper file holding {{'value': tensor, 'meta': dict}}")
    return data["value"], data.get("meta") or {}


def _peek(f: DumpFile) -> tuple:
    """(shape, meta) of a record without reading its values (a memory map of the file, weights_only
    still); (None, {}) when the file cannot be read that way (the real load then says why, in one line)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = torch.load(str(f.path), map_location="cpu", weights_only=True, mmap=True)
        v = d.get("value")
        return (tuple(v.shape) if isinstance(v, torch.Tensor) else None), dict(d.get("meta") or {})
    except Exception:
        return None, {}


def _tp_order(by_rank, ranks) -> list:
    """Ranks in tp_rank order (the order shards concatenate in)."""
    return sorted(ranks, key=lambda r: tp_of(_peek(by_rank[r])[1], by_rank[r])[0])


def tp_of(meta: dict, f: Optional[DumpFile] = None) -> tuple[int, int, str]:
    """(tp_rank, tp_size, source) from the meta's sglang_parallel_info, else the world."""
    info = meta.get("sglang_parallel_info") or {}
    if isinstance(info, dict) and "tp_size" in info and "tp_rank" in info:
        return int(info["tp_rank"]), int(info["tp_size"]), "sglang_parallel_info"
    rank = meta.get("world_rank", f.rank if f else 0)
    return int(rank), int(meta.get("world_size", 1)), "world"


def tp_layout(dims) -> Optional[tuple]:
    """What a dims string says about the tp axis: ('partial', i), ('sharded', i), ('replicated', None),
    or None. i is the tensor dim carrying the modifier (SGLang's grammar: one name per dim)."""
    if not isinstance(dims, str) or not dims.strip():
        return None
    shape, _, decl = dims.partition("#")
    for i, tok in enumerate(shape.split()):
        if "[" in tok and "]" in tok:
            for m in tok[tok.index("[") + 1:tok.rindex("]")].split(","):
                axis, _, qual = m.strip().partition(":")
                if axis == "tp":
                    return ("partial", i) if "partial" in qual.split("+") else ("sharded", i)
    if re.search(r"(^|\s)tp:replicated(\s|$)", decl):
        return ("replicated", None)
    return None


def token_dim(dims) -> int:
    if isinstance(dims, str):
        for i, tok in enumerate(dims.partition("#")[0].split()):
            if tok.split("[")[0] == "t":
                return i
    return 0


# ---- numbers (through the one noise rule) --------------------------------------------------------
def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1)


def measure(x: torch.Tensor, ref: torch.Tensor, judge: Optional[torch.dtype] = None) -> dict:
    """x against ref: level bitwise / noise / material / shape, max_abs, rel_diff, ulp_max."""
    if tuple(x.shape) != tuple(ref.shape):
        return {"level": "shape", "shape": list(x.shape), "ref_shape": list(ref.shape)}
    if not (x.dtype.is_floating_point and ref.dtype.is_floating_point):
        if x.dtype == ref.dtype and torch.equal(x, ref):
            return {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0}
        n = int((x.reshape(-1) != ref.reshape(-1).to(x.dtype)).sum()) if x.numel() else 0
        return {"level": "material", "max_abs": None, "rel_diff": None, "differing": n,
                "first_token": _first_row(x != ref.to(x.dtype))}
    if judge is None or judge == x.dtype:
        fast = fast_level(x, ref)      # bitwise, or noise proved from the bits; None: compare() decides
        if fast is not None:
            return fast
    return _compare_chunked(x, ref, judge)


def _first_row(mask: torch.Tensor) -> Optional[int]:
    rows = mask.reshape(mask.shape[0], -1).any(-1) if mask.dim() >= 1 and mask.shape[0] else mask.reshape(1, -1).any(-1)
    nz = rows.nonzero()
    return int(nz[0, 0]) if nz.numel() else None


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 1 and t.shape[0] > 0 else t.reshape(1, -1)


def _compare_chunked(x: torch.Tensor, ref: torch.Tensor, judge) -> dict:
    """compare() over chunks of token rows, aggregated (memory: a few chunks, not the tensor)."""
    a2, b2 = _rows2d(x), _rows2d(ref)
    rows, cols = a2.shape
    step = max(1, COMPARE_CHUNK // max(cols, 1))
    judge = judge or coarser(x.dtype, ref.dtype)
    lv, first, max_abs, mean_sum, ulp_max, bad, nanm = "bitwise", None, 0.0, 0.0, 0.0, 0.0, 0
    sxx = syy = sxy = 0.0
    for i in range(0, rows, step):
        xc, rc = a2[i:i + step], b2[i:i + step]
        c = compare(xc, rc, dtype=judge)
        k = xc.numel()
        if LEVEL_ORDER.index(c["level"]) > LEVEL_ORDER.index(lv):
            lv = c["level"]
        if first is None and c.get("first_token") is not None:
            first = i + c["first_token"]
        max_abs = max(max_abs, c.get("max_abs", 0.0))
        mean_sum += c.get("mean_abs", 0.0) * k
        ulp_max = max(ulp_max, c.get("ulp_max", 0.0))
        bad += c.get("bad_fraction", 0.0) * k
        nanm += c.get("nan_mismatch", 0)
        if c["level"] != "bitwise":
            xd, rd = xc.double(), rc.double()
            fin = torch.isfinite(xd) & torch.isfinite(rd)
            xd, rd = torch.where(fin, xd, 0.0), torch.where(fin, rd, 0.0)
            sxx += float((xd * xd).sum())
            syy += float((rd * rd).sum())
            sxy += float((xd * rd).sum())
        else:
            s = float((rc.double() ** 2).sum())
            sxx, syy, sxy = sxx + s, syy + s, sxy + s
    n = max(x.numel(), 1)
    rel = 0.0 if sxx + syy == 0 else max(0.0, 1.0 - 2.0 * sxy / (sxx + syy))
    return {"level": lv, "max_abs": max_abs, "mean_abs": mean_sum / n, "rel_diff": rel, "ulp_max": ulp_max,
            "bad_fraction": bad / n, "first_token": first, "nan_mismatch": nanm, "by": "compare()"}


def _bitwise(x: torch.Tensor, ref: torch.Tensor) -> bool:
    if x.shape != ref.shape or x.dtype != ref.dtype:
        return False
    if x.dtype in INT_VIEW:
        it = INT_VIEW[x.dtype][0]
        return torch.equal(_flat(x).view(it), _flat(ref).view(it))
    return torch.equal(x, ref)


def nonfinite_count(t: torch.Tensor) -> int:
    if not has_nonfinite(t):       # from the bits, in chunks
        return 0
    return int((~torch.isfinite(t)).sum())


def rows_nonzero(t: torch.Tensor, tdim: int = 0) -> torch.Tensor:
    t = t.movedim(tdim, 0) if tdim and t.dim() > tdim else t
    return _rows2d(t).ne(0).any(-1)


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


def _where(g: GroupResult) -> str:
    extra = "".join(f" {k}={v}" for k, v in g.tags)
    return f"{g.name}{extra} (step {g.step})"


def check_run(run: DumpRun) -> dict:
    """Cross-rank checks on every group of one dumper run; the findings, per-group readings, coverage."""
    results: list[GroupResult] = []
    replicated_refs: list[tuple] = []   # (step, shape, dtype, file, name) of replicated records (Σ candidates)
    pending: list[tuple] = []           # groups whose ranks differ without a declaration: judged after the scan
    widths: Counter = Counter()
    records = 0
    ref = None
    for (name, tags, step), by_rank in sorted(run.groups.items(),
                                              key=lambda kv: (kv[0][2], min(f.dump_index for f in kv[1].values()))):
        ranks = sorted(by_rank)
        ref_r = ranks[0]
        ref = None           # the previous group's record goes before this one is read
        ref, meta = load(by_rank[ref_r])
        records += 1
        _tp_rank, tp_size, src = tp_of(meta, by_rank[ref_r])
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
                                      detail=f"ranks {missing} have no file for this "
                                      f"record while ranks {ranks} do (a rank-dependent dump or a lost file)"))
        nf = nonfinite_count(ref)
        quick = bool(lay and lay[0] in ("partial", "sharded") and tp_size > 1)
        for r in ranks[1:]:
            x, _m = load(by_rank[r])
            records += 1
            if not isinstance(x, torch.Tensor):
                s = {"level": "shape", "shape": type(x).__name__}
            elif quick:      # declared shards: only "is it a copy?" matters (a dims-mismatch), not the numbers
                s = ({"level": "shape", "shape": list(x.shape)} if x.dim() != ref.dim() else
                     {"level": "bitwise", "max_abs": 0.0, "rel_diff": 0.0} if _bitwise(x, ref)
                     else {"level": "material"})
            else:
                s = measure(x, ref)
            if s["level"] == "material" and isinstance(x, torch.Tensor):
                s["nonfinite"] = nonfinite_count(x)
            g.per_rank[str(r)] = s
            del x
        if nf:
            g.per_rank[str(ref_r)]["nonfinite"] = nf
        if len(ranks) == 1:
            continue
        levels = {r: g.per_rank[str(r)]["level"] for r in ranks[1:]}
        odd = [r for r, lv in levels.items() if lv in ("material", "shape")]
        if ref.dim() >= 2 and (lay is None or lay[0] != "sharded"):
            widths[int(ref.shape[-1])] += 1
        if not odd:
            if lay and lay[0] in ("partial", "sharded") and tp_size > 1 \
                    and all(v == "bitwise" for v in levels.values()) and bool(_flat(ref).ne(0).any()):
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
                                      detail=f"rank {ref_r} dumped shape {list(ref.shape)} {g.dtype}, ranks {odd} "
                                             f"{ {r: s for r, s in shapes.items()} } (a rank-dependent dump)"))
            continue
        nf_ranks = [r for r in odd if g.per_rank[str(r)].get("nonfinite")] + ([ref_r] if nf else [])
        if nf_ranks:
            g.read = "divergent"
            g.findings.append(Finding("non-finite", _where(g), sorted(nf_ranks),
                                      detail=f"NaN/Inf values on ranks {sorted(nf_ranks)} only"))
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
    return {"groups": results, "records": records, "hidden": hidden}


def _classes(by_rank, ranks, ref_r, per_rank) -> list[list[int]]:
    """Ranks grouped by equal values (bitwise or noise), largest group first (loads two records at a time)."""
    groups = [[ref_r] + [r for r in ranks if r != ref_r and per_rank[str(r)]["level"] in ("bitwise", "noise")]]
    for r in ranks:
        if r in groups[0]:
            continue
        x, _ = load(by_rank[r])
        for grp in groups[1:]:
            y, _ = load(by_rank[grp[0]])
            if measure(x, y)["level"] in ("bitwise", "noise"):
                grp.append(r)
                break
        else:
            groups.append([r])
    return sorted(groups, key=lambda grp: (-len(grp), grp[0]))


def _sum_over(by_rank, ranks, tdim: int = 0, masks: bool = True):
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
    classes = _classes(by_rank, ranks, ref_r, g.per_rank)
    if len(classes[0]) * 2 > world:
        bad = sorted(r for c in classes[1:] for r in c)
        _divergent(g, bad, g.per_rank.get(str(bad[0]), {}) if classes[0][0] == ref_r else {},
                   f"the {len(classes[0])} ranks that agree", "", declared, classes)
        return
    tdim = token_dim(g.declared)
    total, masks = _sum_over(by_rank, ranks, tdim)
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
                                         f"of the elements (rel diff ≥ {min(s['rel_diff'] for s in stats):.2g}): a "
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
                              detail=f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} differ materially "
                                     f"from "
                                     f"{against} (max abs diff {s.get('max_abs', 0) or 0:.3g}, rel diff "
                                      f"{s.get('rel_diff', 0) or 0:.3g}, first token "
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
            f.where = f"{name}{extra} (steps {_span(steps)})"
        f.evidence = {**f.evidence, "steps": steps}
        out.append(f.to_json())
    order = {FAILURE: 0, WARNING: 1, INFO: 2}
    return sorted(out, key=lambda d: order[d["severity"]])


def _span(steps) -> str:
    s = sorted(set(steps))
    return f"{s[0]}-{s[-1]}" if len(s) > 2 and s == list(range(s[0], s[-1] + 1)) else ", ".join(map(str, s))


@contextmanager
def one_thread():
    """torch on one thread for the passes over the records: each is memory-bound and short (a chunk of
    rows), and on a busy machine intra-op threads wait on each other (bench/dumper_vs_comparator.py
    on the 2-core dev box under load: diff 9.7 s with 2 threads, 2.2 s with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


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
    return {"schema": SCHEMA_REPORT, "path": str(run.path), "ranks": run.ranks, "steps": run.steps, "tp_size": tp_size,
            "tp_source": groups[0].tp_source if groups else None, "hidden": res["hidden"],
            "coverage": {"files": len(run.files), "records_read": res["records"], "groups": len(groups),
                         "names": len(run.names()),
                         "checked": sum(1 for g in groups if g.read != "not a tensor"),
                         "not_tensors": [_where(g) for g in groups if g.read == "not a tensor"]},
            "records": [_group_json(g) for g in groups], "findings": findings, "exit_code": exit_code(findings),
            "_groups": groups}


def _group_json(g: GroupResult) -> dict:
    return {"name": g.name, "tags": dict(g.tags), "step": g.step, "shape": g.shape, "dtype": g.dtype,
            "tp_size": g.tp_size, "declared_dims": g.declared, "read": g.read, "sharded_dim": g.sharded_dim,
            "per_rank": g.per_rank, "evidence": {k: v for k, v in g.evidence.items() if k != "groups"}}


# ---- --emit-dims ---------------------------------------------------------------------------------------
def dims_for(g: GroupResult) -> tuple[str, str]:
    """The dims string SGLang's comparator needs for this record, and why (from what was measured)."""
    nd = len(g.shape)
    names = (["t"] + [f"d{i}" for i in range(1, nd - 1)] + ["h"]) if nd >= 2 else (["t"] if nd == 1 else [])
    lay = tp_layout(g.declared)
    if lay and lay[0] == g.read and g.read in ("partial", "sharded"):
        return g.declared, "as declared in the dump, and the ranks agree with it"
    if not names:
        return "1", "a scalar"
    if g.read == "partial":
        i = nd - 1
        names[i] += "[tp:partial]"
        why = "measured: " + ("disjoint non-zero token rows across ranks" if "rows_nonzero_on_one_rank" in g.evidence
                              and g.evidence.get("rows_nonzero_on_one_rank", 0) >= 0.9 else
                              f"Σ over ranks equals {g.evidence['sum_equals']}" if g.evidence.get("sum_equals") else
                              "declared partial" if g.evidence.get("declared") else "ranks differ everywhere "
                                                                                    "(suspected partial)")
        return " ".join(names), why
    if g.read == "sharded":
        i = g.sharded_dim if g.sharded_dim is not None else nd - 1
        names[i] += "[tp]"
        return " ".join(names), "measured: a TP slice (width × tp = hidden)" if not g.declared else "declared sharded"
    if g.tp_size <= 1:
        return " ".join(names), "tp 1: nothing to unshard"
    if g.read == "replicated":
        lv = {s.get("level") for s in g.per_rank.values()} - {"reference"}
        return " ".join(names) + " # tp:replicated", \
            f"measured: every rank {'bitwise equal' if lv <= {'bitwise'} else 'equal within rounding'}"
    return " ".join(names) + " # tp:replicated", \
        f"ranks disagree ({g.read}): replicated is what it should be; the comparator will fail it"


def emit_dims_text(data: dict) -> str:
    """A YAML file for `python -m sglang.srt.debug_utils.comparator --override-config FILE`."""
    per: dict = {}
    for g in data["_groups"]:
        if g.read == "not a tensor":
            continue
        d, why = dims_for(g)
        per.setdefault(g.name, {}).setdefault(d, (why, []))[1].append(g.step)
    lines = [f"# tpprobe --emit-dims: dims for SGLang's comparator, from what tpprobe measured on {data['path']}",
             f"# (tp {data['tp_size']}, {len(data['ranks'])} ranks, steps "
             f"{_span(data['steps']) if data['steps'] else '-'})",
             "# use: python -m sglang.srt.debug_utils.comparator --override-config THIS_FILE ...",
             "overrides:"]
    for name, ds in per.items():
        pat = "^" + re.escape(name) + "$"
        if len(ds) > 1:
            lines.append(f"  # {name}: the steps disagree "
                         f"({'; '.join(f'{d} at steps {_span(s)}' for d, (_, s) in ds.items())});"
                         f" the first is used")
        d, (why, steps) = next(iter(ds.items()))
        lines.append(f"  - match: {json.dumps(pat)}   # {why}")
        lines.append(f"    dims: {json.dumps(d)}")
    return "\n".join(lines) + "\n"


# ---- rendering (report) ----------------------------------------------------------------------------------
def render_report(data: dict, con) -> None:
    from rich.table import Table
    from rich.text import Text

    from ..report.labels import cell_label
    from ..report.terminal import LEVEL_STYLE
    cov = data["coverage"]
    con.rule(f"[bold]tpprobe dumper report[/] — {data['path']} · tp={data['tp_size']} · "
             f"{len(data['ranks'])} ranks · steps {_span(data['steps']) if data['steps'] else '-'}")
    t = Table(title="records × ranks", header_style="bold")
    for c in ("name", "step", "shape", "read"):
        t.add_column(c, no_wrap=True)
    for r in data["ranks"]:
        t.add_column(f"rank {r}")
    for rec in data["records"]:
        extra = "".join(f" {k}={v}" for k, v in rec["tags"].items())
        row = [rec["name"] + extra, str(rec["step"]), f"{rec['shape']} {rec['dtype']}",
               rec["read"] + (" (declared)" if rec["declared_dims"] and rec["read"] in ("partial", "sharded")
                              and tp_layout(rec["declared_dims"]) and tp_layout(rec["declared_dims"])[0] == rec["read"]
                              else "")]
        for r in data["ranks"]:
            s = rec["per_rank"].get(str(r))
            row.append(Text(cell_label(s), style=LEVEL_STYLE.get((s or {}).get("level", "?"), "")) if s
                       else Text("—", style="dim"))
        t.add_row(*row)
    con.print(t)
    con.print(Text(f"coverage: {cov['files']} files, {cov['records_read']} read, {cov['groups']} records over "
                   f"{cov['names']} names, {cov['checked']} checked across ranks"
                   + (f"; not tensors (skipped): {', '.join(cov['not_tensors'][:4])}" if cov["not_tensors"] else ""),
                   style="dim"))
    con.print(Text("verdict", style="bold"))
    for f in data["findings"]:
        style = {"failure": "bold red", "warning": "yellow", "info": "cyan"}[f["severity"]]
        con.print(Text(f"  {f['line']}", style=style), soft_wrap=True)
        if f["severity"] != "info" and f.get("explain"):
            con.print(Text(f"    why: {f['explain']}", style="dim"), soft_wrap=True)
    if not any(f["severity"] != "info" for f in data["findings"]):
        con.print(Text(f"  HEALTHY: all {cov['checked']} records agree across ranks or are declared/identified "
                       f"shards ({cov['records_read']} rank records read)", style="bold green"))


def report_command(path: Path, json_out: bool = False, quiet: bool = False, emit_dims: bool = False) -> int:
    data = report_data(path)
    if data["coverage"]["checked"] == 0:
        raise CaptureError(f"{data['path']}: no tensor records to check; expected {EXPECTED}")
    if emit_dims:      # the dims are what was asked for: written, exit 0; the findings are named on stderr
        sys.stdout.write(emit_dims_text(data))
        if data["exit_code"]:
            print(f"tpprobe: the dims were written; the dump also has findings: `tpprobe report {path}` "
                  f"names them", file=sys.stderr)
        return 0
    if json_out:
        sys.stdout.write(json.dumps(_public(data), indent=1, default=str) + "\n")
    elif not quiet:
        from ..report.terminal import console
        render_report(data, console())
    return data["exit_code"]


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


# ---- two runs: diff ------------------------------------------------------------------------------------
@dataclass
class Full:
    """One side's record of (name, step), unsharded to the full tensor."""
    value: torch.Tensor
    how: str            # how it was unsharded
    source: str         # dims | inferred | tp 1
    tdim: int
    odd_ranks: list = field(default_factory=list)       # declared replicated, but these ranks differ from the first
    sum_all: Optional[torch.Tensor] = None              # then: Σ over ranks, to name a partial


def unshard(run: DumpRun, key, other_shape: Optional[tuple]) -> Full:
    """The full tensor of one group: tp ranks concatenated, summed or the replica, as the meta's dims
    say, or as inferred from the values (and the other side's shape) when they say nothing. Holds
    the result and at most two rank records at a time."""
    by_rank = run.groups[key]
    ranks = sorted(by_rank)
    shape0, meta0 = _peek(by_rank[ranks[0]])
    _r, tp_size, _src = tp_of(meta0, by_rank[ranks[0]])
    lay = tp_layout(meta0.get("dims"))
    tdim = token_dim(meta0.get("dims"))
    if len(ranks) == 1 or tp_size == 1:
        return Full(_tensor(by_rank[ranks[0]]), "as is" if tp_size == 1 else f"rank {ranks[0]} only",
                    "tp 1" if tp_size == 1 else "one file", tdim)
    if lay and lay[0] == "sharded":
        return Full(_concat(by_rank, ranks, lay[1]), f"cat dim {lay[1]} × {len(ranks)} ranks", "dims", tdim)
    if lay and lay[0] == "partial":
        return Full(_sum_over(by_rank, ranks, tdim, masks=False)[0], f"Σ {len(ranks)} ranks", "dims", tdim)
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
            if not lay:
                break
    if lay:      # declared replicated: the first rank is the value; ranks that differ are named
        total = _sum_over(by_rank, ranks, tdim, masks=False)[0] if odd else None
        return Full(first, f"rank {ranks[0]} (replicated)", "dims", tdim, odd_ranks=odd, sum_all=total)
    if not odd:
        return Full(first, f"rank {ranks[0]} (replicated)", "inferred: ranks equal", tdim)
    del first
    # no dims, and the ranks differ: summed to compare, but a partial sum is never passed off as a
    # match (`tpprobe report` names such a record partial-allreduce): every rank is an odd one
    total = _sum_over(by_rank, ranks, tdim, masks=False)[0]
    return Full(total, f"Σ {len(ranks)} ranks", "inferred: ranks differ", tdim, odd_ranks=list(ranks), sum_all=total)


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
                                       f"{r.get('max_abs') or 0:.3g}, rel diff {r.get('rel_diff') or 0:.3g}, first "
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
                                        detail=f"its dims declare it replicated, but ranks {o['ranks']} differ from "
                                               f"the first "
                                               f"and Σ over the {side}'s ranks equals the {other}: each rank holds a "
                                               f"partial "
                                               f"sum (its all-reduce had not run)",
                                               evidence={"all_ranks": True}).to_json())
            else:
                findings.append(Finding("rank-divergence", f"{r['name']} (step {r['step']}, {side})", o["ranks"],
                                        detail=f"its dims declare it replicated, but ranks {o['ranks']} differ "
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
    return Full(v, f0.how, f0.source, f0.tdim, odd_ranks=odd, sum_all=total)


def _diff_one(b, t, bkeys, tkeys, name, tags, step, n_tokens) -> dict:
    # a target with one file per record gives the full shape the baseline's shards must add up to
    tgroup = t.groups[tkeys[0]]
    tshape = _peek(tgroup[min(tgroup)])[0] if len(tgroup) == 1 else None
    bfull = _cat(b, bkeys, tshape, n_tokens)
    tfull = _cat(t, tkeys, tuple(bfull.value.shape), n_tokens)
    s = measure(tfull.value, bfull.value)
    odd = {}
    for side, mine, other in (("baseline", bfull, tfull), ("target", tfull, bfull)):
        if mine.odd_ranks:
            m = measure(mine.sum_all, other.value)["level"] if mine.sum_all is not None else "shape"
            run, keys = (b, bkeys) if side == "baseline" else (t, tkeys)
            odd[side] = {"ranks": mine.odd_ranks, "all_ranks": sorted(run.groups[keys[0]]),
                         "sum_matches": m in ("bitwise", "noise"), "declared": mine.source == "dims"}
    row = {"odd": odd, "name": name + "".join(f" {k}={v}" for k, v in tags), "step": step,
           "baseline_how": f"{bfull.how} [{bfull.source}]", "target_how": f"{tfull.how} [{tfull.source}]",
           "inferred": [side for side,
                        f in (("baseline", bfull), ("target", tfull)) if f.source.startswith("inferred")],
           "shape": list(tfull.value.shape), "dtype": str(tfull.value.dtype).replace("torch.", ""),
           "target_ranks": sorted(t.groups[tkeys[0]]), **s}
    return row


def render_diff(data: dict, con) -> None:
    from rich.table import Table
    from rich.text import Text

    from ..report.terminal import LEVEL_STYLE
    con.print(Text(f"baseline: {data['baseline']}", style="dim"))
    con.print(Text(f"target:   {data['target']}", style="dim"))
    for n in data["notes"]:
        con.print(Text(f"tokens:   {n}", style="dim"), soft_wrap=True)
    tab = Table(header_style="bold")
    for c in ("name", "step", "shape", "baseline", "target", "level", "max abs", "rel diff", "ULP max"):
        tab.add_column(c, no_wrap=c not in ("baseline", "target"))
    for r in data["rows"]:
        tab.add_row(Text(r["name"]), r["step"], f"{r['shape']} {r['dtype']}",
                    Text(r["baseline_how"]), Text(r["target_how"]),
                    Text(r["level"], style=LEVEL_STYLE.get(r["level"], "")),
                    "–" if r.get("max_abs") is None else f"{r['max_abs']:.3g}",
                    "–" if r.get("rel_diff") is None else f"{r['rel_diff']:.2e}",
                    "–" if r.get("ulp_max") is None else f"{r['ulp_max']:g}")
    con.print(tab)
    inferred = [r["name"] for r in data["rows"] if r["inferred"]]
    if inferred:
        con.print(Text(f"unsharded by inference (the meta has no tp dims for them): {', '.join(sorted(set(inferred)))}",
                       style="yellow"), soft_wrap=True)
    for f in data["findings"]:
        style = {"failure": "bold red", "warning": "yellow", "info": "cyan"}[f["severity"]]
        con.print(Text(f"  {f['line']}", style=style), soft_wrap=True)
    if not any(f["severity"] == FAILURE for f in data["findings"]):
        lv = Counter(r["level"] for r in data["rows"])
        con.print(Text(f"MATCH: all {len(data['rows'])} records equal the baseline after unsharding "
                       f"({lv.get('bitwise', 0)} bitwise, {lv.get('noise', 0)} within rounding)", style="bold green"))


def diff_command(baseline: Path, target: Path, json_out: bool = False) -> int:
    data = diff_data(baseline, target)
    if json_out:
        sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
    else:
        from ..report.terminal import console
        render_diff(data, console())
    return data["exit_code"]

