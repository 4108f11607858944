"""--keep: the full prompt rows only where a cell is not bitwise (and the reference's counterparts),
with exact statistics from the tensors; the rest of each rank's tensors is deleted."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from .options import cname


def keep_tensors(root: Path, runs, report, opts) -> dict:
    """Rewrite each rank's tensors to the cells that are not bitwise (plus the reference's
    counterparts), with exact statistics from the tensors; delete the rest."""
    from safetensors.torch import load_file
    from ..formats.capture_dir import atomic_save_tensors
    from ..core.noise import compare as tcompare
    R = opts.ref
    raw = {}
    for tp in runs:
        for r in range(tp):
            f = root / f"tp{tp}" / f"rank{r}.safetensors"
            raw[(tp, r)] = load_file(str(f)) if f.exists() else {}
    needed: dict[tuple[int, int], set] = {}
    n_cells = 0
    for e in report["rows"]:
        for c in opts.configs:
            for side, cells in (("out", e["cells"]), ("in", e["in_cells"] or {})):
                cell = cells.get(cname(c))
                if not cell or cell["level"] in ("bitwise", "reference", "n/a", "missing"):
                    continue
                vs = R if side == "out" else cfg_of(cell.get("vs"), R)
                k = f"{e['key']}|{side}"
                ranks = range(c[0]) if side == "in" else [0]
                for r in ranks:
                    a, b = raw[(c[0], r)].get(f"b{c[1]}|{k}"), raw[(vs[0], r)].get(f"b{vs[1]}|{k}")
                    if a is None or b is None:
                        continue
                    needed.setdefault((c[0], r), set()).add(f"b{c[1]}|{k}")
                    needed.setdefault((vs[0], r), set()).add(f"b{vs[1]}|{k}")
                    if r == (cell.get("ranks") or [0])[0] or side == "out":
                        st = tcompare(a, b)
                        cell.update({x: st[x] for x in ("max_abs", "ulp_max", "first_token") if x in st})
                n_cells += 1
    files = []
    tdir = root / "tensors"
    tdir.mkdir(parents=True, exist_ok=True)
    for (tp, r), ts in raw.items():
        keep = {k: v for k, v in ts.items() if k in needed.get((tp, r), set())}
        if keep:
            dst = tdir / f"tp{tp}-rank{r}.safetensors"
            atomic_save_tensors(dst, {k.replace("|", "/"): v for k, v in keep.items()}, {})
            files.append(str(dst))
        f = root / f"tp{tp}" / f"rank{r}.safetensors"
        if f.exists():
            f.unlink()
    return {"cells": n_cells, "files": files}


def cfg_of(name: Optional[str], default):
    m = re.fullmatch(r"tp(\d+)·b(\d+)", name or "")
    return (int(m.group(1)), int(m.group(2))) if m else default
