"""The words every part of `tpprobe invariance` shares: the report's schema, the sketch every run
signs with, the levels a cell can take (worst last) and how one cell is judged against another."""
from __future__ import annotations

from typing import Optional

from ..core.noise import LEVEL_RANK

SCHEMA = "tpprobe.invariance/1"
FP_SEED, FP_K = 0x7470, 32          # the probe's sketch seed and size (every run signs alike)
RANK = LEVEL_RANK                   # core/noise.py declares the levels and their order


def _fp(cell: Optional[dict]):
    from ..fingerprint.reference import Fingerprint
    return None if cell is None else Fingerprint.from_json(cell["fp"])


def level(a: Optional[dict], b: Optional[dict]) -> dict:
    """a against b (cells of two configurations): level and the sketch's relative difference."""
    from ..core.noise import judge_dtype
    from ..fingerprint.levels import fp_dtype, fp_level, fp_rel
    if a is None or b is None:
        return {"level": "missing"}
    fa, fb = _fp(a), _fp(b)
    if not (a.get("per_token", True) and b.get("per_token", True)) and fa.shape != fb.shape:
        return {"level": "n/a", "why": "not laid out by token: its shape follows the batch"}
    lv = fp_level(fa, fb, judge_dtype(fp_dtype(fa), fp_dtype(fb), fp_dtype(fb)))
    out = {"level": lv}
    if lv in ("noise", "material"):
        out["rel"] = fp_rel(fa, fb)
    return out


def worst(cells: list[dict]) -> dict:
    cells = [c for c in cells if c["level"] in RANK]
    return max(cells, key=lambda c: RANK[c["level"]]) if cells else {"level": "n/a"}


def human_bytes(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
