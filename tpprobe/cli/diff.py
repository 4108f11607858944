"""`tpprobe diff`: load both sides (every rank with --all-ranks), split, align, match, and print."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..eagle3.diff.compare import default_threshold, parse_thresholds
from ..eagle3.diff.load import Side, load_side, side_of_run, split_slots
from ..eagle3.diff.match import diff_sides
from ..eagle3.diff.render import diff_report
from ..eagle3.diff.tokens import align

SCHEMA = "tpprobe.diff/1"


# ---- running it ------------------------------------------------------------------------------
def run_diff(baseline, target, rank: int = 0, all_ranks: bool = False, slots: Optional[int] = None,
             hidden: Optional[int] = None, offset: Optional[int] = None,
             threshold: Optional[str] = None) -> dict:
    if slots is not None and slots < 1:
        raise UsageError(f"--slots must be >= 1 (got {slots})")
    if hidden is not None and hidden < 1:
        raise UsageError(f"--hidden must be >= 1 (got {hidden})")
    pairs = _rank_pairs(Path(baseline), Path(target), rank, all_ranks)
    results = []
    for b, t in pairs:
        split_slots(b, hidden, slots, t)
        split_slots(t, hidden, slots, b)
        if b.hidden != t.hidden:
            raise UsageError(f"slot widths differ: baseline {b.path} has hidden {b.hidden}, target {t.path} "
                             f"{t.hidden}; these are captures of different models (or pass --hidden)")
        al = align(b, t, offset)
        default = default_threshold(b, t)
        thr = parse_thresholds(threshold, len(t.slots), default)
        res = diff_sides(b, t, al, thr, max(thr + [default]))
        res.update(baseline=b.describe(), target=t.describe(), alignment=al, thresholds=thr,
                   default_threshold=default, baseline_text=b.text(), target_text=t.text())
        results.append(res)
    ok = all(r["ok"] for r in results)
    return {"schema": SCHEMA, "ok": ok, "exit_code": 0 if ok else 1, "results": results}


def _rank_pairs(bp: Path, tp: Path, rank: int, all_ranks: bool) -> list[tuple[Side, Side]]:
    if not all_ranks:
        return [(load_side("baseline", bp, rank), load_side("target", tp, rank))]
    from ..formats.capture_dir import load_run
    runs = {p: load_run(p) for p in (bp, tp) if p.is_dir()}
    if not runs:
        raise UsageError("--all-ranks needs at least one capture folder (both are files)")
    if tp in runs:
        t_ranks = sorted(runs[tp].records) or [rank]
    else:
        t_ranks = None
    b_ranks = sorted(runs[bp].records) if bp in runs else None
    out = []
    for r in (t_ranks or b_ranks):
        t = side_of_run("target", runs[tp], r) if tp in runs else load_side("target", tp)
        if bp in runs:
            br = r if r in runs[bp].records else rank
            b = side_of_run("baseline", runs[bp], br)
        else:
            b = load_side("baseline", bp)
        out.append((b, t))
    return out


def diff_command(baseline: Path, target: Path, rank: int = 0, all_ranks: bool = False, slots: Optional[int] = None,
                 hidden: Optional[int] = None, offset: Optional[int] = None, threshold: Optional[str] = None,
                 json_out: bool = False, html: Optional[str] = None, markdown: Optional[str] = None) -> None:
    """Compare two runs of the same tokens slot by slot: training dump vs serving capture, tp=1 vs tp=N;
    or two SGLang dumper folders, name by name, each unsharded to the full tensors.
    Bad input raises TPProbeError: cli.main prints it (one line; the traceback with --debug)."""
    from ..formats.capture_dir import check_file_path
    for flag, path in (("--html", html), ("--markdown", markdown)):
        if path:
            check_file_path(Path(path), flag)
    from ..formats.sglang_dump import is_dumper_dir, refuse_several_dumps
    for side in (baseline, target):       # the dumper's `dir`, one folder per experiment: which one?
        refuse_several_dumps(side)
    if is_dumper_dir(baseline) or is_dumper_dir(target):
        if not (is_dumper_dir(baseline) and is_dumper_dir(target)):
            raise UsageError(f"{baseline if is_dumper_dir(baseline) else target} is an SGLang dumper folder and "
                             f"{target if is_dumper_dir(baseline) else baseline} is not: compare two dumper folders")
        from ..dumpdir.report import diff_command as dumper_diff
        raise typer.Exit(dumper_diff(baseline, target, json_out=json_out, html=html, markdown=markdown))
    rep = run_diff(baseline, target, rank=rank, all_ranks=all_ranks, slots=slots, hidden=hidden,
                   offset=offset, threshold=threshold)
    from ..report.emit import Flags, emit
    emit(diff_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown))
    raise typer.Exit(rep["exit_code"])
