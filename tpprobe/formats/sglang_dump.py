"""SGLang's dumper folders, read: the file names, the folder, one record loaded safely, the meta's tp dims.

The format (`sglang.srt.debug_utils.dumper`): one `torch.save` file per tensor per rank per call,
named `step=S___rank=R___dump_index=I___name=N___<tag>=<v>….pt`, holding
`{"value": tensor, "meta": {filename keys, world_rank, world_size, sglang_parallel_info (tp_rank,
tp_size, …), dims (when the caller gave them), …}}`. A folder is a dumper folder when its `.pt`
files carry step, rank and name in their names (or it has exactly one such subfolder, as SGLang's
comparator accepts).

Loading is safe and streamed: `torch.load(weights_only=True)` through formats/safe_load.py, one
file at a time, memory-mapped (`mmap=True`: the values are read from the page cache where they are
used, not copied first; a file that cannot be mapped is read whole); a group (one name, step and
tag set) holds the reference rank's record and one other record at a time, so memory is bounded by
two records, not the folder.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .safe_load import torch_load
from ..core.errors import CaptureError, UsageError

REQUIRED_KEYS = ("step", "rank", "name")
# filename keys that are not part of a record's identity across ranks
NON_IDENTITY = {"step", "rank", "dump_index", "name", "recompute_status",
                "pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"}
EXPECTED = ("an SGLang dumper folder (files step=S___rank=R___dump_index=I___name=N….pt written by "
            "sglang.srt.debug_utils.dumper, or a folder holding exactly one such folder)")


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


def _dump_files(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_file() and parse_name(p.name) is not None]
    except OSError:
        return []


def holds_dump_files(path) -> bool:
    """Does the folder itself hold dumper files (not only a subfolder)?"""
    p = Path(path)
    return p.is_dir() and bool(_dump_files(p))


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


def dumper_experiments(path) -> list[str]:
    """The subfolders of `path` that hold dumper files: SGLang's dumper writes one per experiment
    (`exp_name`) under its `dir`."""
    p = Path(path)
    if not p.is_dir():
        return []
    try:
        return [d.name for d in sorted(p.iterdir()) if d.is_dir() and _dump_files(d)]
    except OSError:
        return []


def refuse_several_dumps(path) -> None:
    """One line when `path` is the dumper's `dir` holding several experiment folders (no dumper files of
    its own, no capture): which it holds, and to pass one of them."""
    p = Path(path)
    if not p.is_dir() or (p / "manifest.json").exists() or _dump_files(p):
        return
    exps = dumper_experiments(p)
    if len(exps) > 1:
        shown = ", ".join(exps[:4]) + (f" and {len(exps) - 4} more" if len(exps) > 4 else "")
        raise UsageError(f"{p} holds {len(exps)} SGLang dumper experiments ({shown}), not one dumper folder: "
                         f"pass one of them, e.g. {p / exps[0]}")


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
        refuse_several_dumps(p)
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
        try:       # mapped: the bytes are read where they are compared, not copied first
            data = torch_load(str(path), mmap=True, quiet=True)
        except pickle.UnpicklingError:
            raise
        except Exception:      # not mappable (an old format, a pipe): read it whole; its errors are said below
            data = torch_load(str(path), quiet=True)
    except pickle.UnpicklingError as e:
        from .safe_load import refusal
        raise CaptureError(refusal(path, e))
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, KeyError, AttributeError,
            TypeError, IndexError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CaptureError(f"{path}: not a readable torch.save file ({first[:140]}); re-dump it or remove it")
    if not isinstance(data, dict) or "value" not in data or not isinstance(data.get("meta", {}), dict):
        what = f"a dict with keys {list(data)[:6]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise CaptureError(f"{path}: holds {what}; expected a dumper file holding {{'value': tensor, 'meta': dict}}")
    return data["value"], data.get("meta") or {}


def peek(f: DumpFile) -> tuple:
    """(shape, meta) of a record without reading its values (a memory map of the file, weights_only
    still); (None, {}) when the file cannot be read that way (the real load then says why, in one line)."""
    try:
        d = torch_load(str(f.path), mmap=True, quiet=True)
        v = d.get("value")
        return (tuple(v.shape) if isinstance(v, torch.Tensor) else None), dict(d.get("meta") or {})
    except Exception:
        return None, {}


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
