"""`tpprobe report DIR [DIR2 ...]` over a watch run (TPPROBE_WATCH: tpprobe/engines/watch.py).

A watch folder holds, per TP group (dp{D}-pp{P}/), each rank's rolling summary `watch-rank-{R:03d}.json`
(forwards checked, healthy, the failing steps) and one step folder per failing forward that was kept.
On a TP group spread over nodes each node's folder holds its own ranks' summaries and rank files, TP rank
0's the manifests: the folders given are merged into one run (no shared filesystem assumed), and the
report says which ranks each held. Every failing step is named, first first, each checked again from its
files as `tpprobe report` checks one step folder, with the count of healthy forwards; the first failing
step's full report follows. Exit 1 on any failing step, 0 when every checked forward was healthy, 2 when
the folders hold no watch run or nothing was checked.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from ..core.errors import UsageError
from ..engines.vllm.acceptance import LOW
from ..formats.acceptance import summary
from ..report.words import NOT_CHECKED_ONE_RANK

SCHEMA = "tpprobe.watch/1"
_SUMMARY = re.compile(r"^watch-rank-(\d{3,})\.json$")
_STEP = re.compile(r"^step-(\d+)-([a-z0-9_]+)$")


def is_watch_dir(path: Path) -> bool:
    """Whether `path` holds a watch run (a rank's summary in it or in a TP group folder below it)."""
    path = Path(path)
    return path.is_dir() and any(_SUMMARY.match(p.name) for p in path.glob("*/watch-rank-*.json")) \
        or any(_SUMMARY.match(p.name) for p in path.glob("watch-rank-*.json"))


def _summaries(root: Path) -> list[tuple[str, dict, Path]]:
    out = []
    for p in sorted(list(root.glob("watch-rank-*.json")) + list(root.glob("*/watch-rank-*.json"))):
        if not _SUMMARY.match(p.name):
            continue
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{p}: not a readable watch summary ({type(e).__name__}: {str(e)[:120]}); it is corrupt")
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or type(doc.get("rank")) is not int:
            raise UsageError(f"{p}: not a tpprobe watch summary (schema {SCHEMA} with a rank expected)")
        group = p.parent.relative_to(root).as_posix()
        out.append(("." if group == "." else group, doc, p))
    return out


def _step_folders(root: Path, group: str) -> dict[str, Path]:
    base = root if group == "." else root / group
    return {d.name: d for d in sorted(base.glob("step-*")) if d.is_dir() and _STEP.match(d.name)}


def _merged(parts: list[Path], tmp: Path) -> Path:
    """One step folder from its per-node parts: every rank's files and the manifest, copied side by side."""
    if len(parts) == 1:
        return parts[0]
    out = tmp / f"{len(list(tmp.iterdir()))}-{parts[0].name}"
    out.mkdir()
    for part in parts:
        for f in part.iterdir():
            if f.is_file() and not (out / f.name).exists():
                shutil.copyfile(f, out / f.name)
    return out


def watch_report(dirs: list[Path], json_out: bool = False, quiet: bool = False) -> int:
    from .report import check_dir
    from ..probe.report import probe_report
    from ..report.emit import Flags, console, emit

    dirs = [Path(d) for d in dirs]
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"{d}: no such folder; give the folders TPPROBE_CAPTURE_DIR named on each node")
    held: dict[str, dict] = {}
    groups: dict[str, dict] = {}
    for d in dirs:
        found = _summaries(d)
        if not found:
            raise UsageError(f"{d} holds no watch summary (watch-rank-NNN.json): point tpprobe report at the folder "
                             f"TPPROBE_CAPTURE_DIR named while TPPROBE_WATCH was set")
        held[str(d)] = {"ranks": sorted({doc["rank"] for _, doc, _ in found}),
                        "groups": sorted({g for g, _, _ in found})}
        for group, doc, _ in found:
            g = groups.setdefault(group, {"summaries": {}, "steps": {}})
            g["summaries"][doc["rank"]] = doc
            for name, path in _step_folders(d, group).items():
                g["steps"].setdefault(name, []).append(path)
    rows, first = [], None
    totals = {"checked": 0, "healthy": 0, "failing": 0, "not_kept": 0, "warned": 0}
    notes, one_rank = [], []
    with tempfile.TemporaryDirectory(prefix="tpprobe-watch-") as tmp:
        for group in sorted(groups):
            g = groups[group]
            docs = g["summaries"]
            world = max(int(doc.get("world_size") or 1) for doc in docs.values())
            if world == 1:      # no peer: its forwards were checked on their own, never across ranks
                one_rank.append(group)
            lead = docs.get(0) or docs[min(docs)]
            for k in ("checked", "healthy", "failing", "not_kept", "warned"):
                totals[k] += max(int(doc.get(k) or 0) for doc in docs.values())
            missing = [r for r in range(world) if r not in docs]
            if missing:
                notes.append(f"{group}: no summary of rank(s) {missing} in the folders given (their node's folder "
                             f"is missing?)")
            if lead.get("warning"):
                w = lead["warning"]
                notes.append(f"{group}: {lead.get('warned')} checked forward(s) with a warning, not healthy; the "
                             f"first, step {w.get('step')}: {w.get('kind')} at {w.get('where')}: {w.get('detail')}")
            stopped = {r: doc["stopped"] for r, doc in docs.items() if doc.get("stopped")}
            if stopped:
                r0 = min(stopped)
                notes.append(f"{group}: the watch stopped ({stopped[r0]}); forwards after it were not checked")
            listed = {f"step-{int(x['step']):06d}-{x['forward_mode']}": x for x in lead.get("findings") or []}
            for name in sorted(set(g["steps"]) | set(listed), key=lambda n: int(_STEP.match(n).group(1))):
                hit = _STEP.match(name)
                step, mode = int(hit.group(1)), hit.group(2)
                row = {"group": group, "step": step, "forward_mode": mode, "folder": None, "failures": None,
                       "first": None}
                if name in g["steps"]:
                    parts = g["steps"][name]
                    row["folder"] = [str(p) for p in parts]
                    rep = check_dir(_merged(parts, Path(tmp)))
                    fails = [f for f in rep["findings"] if f["severity"] == "failure"]
                    row["failures"] = len(fails)
                    if fails:
                        f0 = fails[0]
                        row["first"] = {k: f0[k] for k in ("kind", "where", "ranks")} | {"detail": f0.get("detail")}
                        if first is None or step < first[1]:
                            first = (group, step, rep)
                else:       # counted, its record over TPPROBE_MAX_BYTES
                    x = listed[name]
                    row["failures"] = x.get("failures")
                    row["first"] = {k: x.get(k) for k in ("kind", "where", "ranks", "detail")}
                    row["not_kept"] = True
                if row["failures"]:
                    rows.append(row)
    rows.sort(key=lambda r: (r["step"], r["group"]))
    failing = len(rows) or totals["failing"]
    acc = engine_acceptance(dirs)
    low = acc is not None and acc.get("rate") is not None and acc["rate"] < LOW
    if low and not failing:
        # the target's forwards agree, the draft's acceptance does not: the watch never looks at the draft's input
        notes.append(f"the engine's acceptance is {acc['rate']:.2f} while every checked forward of the target agreed "
                     f"on every rank: the watch checks the target's forwards, not what the EAGLE-3 draft receives; "
                     f"capture a few steps with TPPROBE_CAPTURE_DIR and without TPPROBE_WATCH, and `tpprobe report` "
                     f"checks the draft's input against the draft and proposes ids")
    across = len(one_rank) < len(groups)
    if one_rank and across:
        notes.append(f"{', '.join(one_rank)}: one rank (tp 1): its forwards were not checked across ranks")
    doc = {"watch": {"folders": held, **totals, "failing_steps": [
        {k: r[k] for k in ("group", "step", "forward_mode", "first")} for r in rows], "notes": notes,
        "acceptance": acc, "one_rank_groups": one_rank}}
    if totals["checked"] == 0 and not rows:
        raise UsageError("the watch checked no forward in these folders (the engine served none while TPPROBE_WATCH "
                         "was on, or the summaries were never written): nothing to report")
    code = 1 if failing else 0
    if json_out:
        out = dict(first[2]) if first else {}
        out.pop("out", None)
        print(json.dumps({**out, **doc, "exit_code": code}, indent=1, default=str))
        return code
    con = console()
    folders = "; ".join(f"{d}: ranks {h['ranks']}" for d, h in held.items())
    con.print(f"tpprobe watch report over {len(dirs)} folder(s) ({folders}): {totals['checked']} forward(s) checked"
              + (f", {totals['healthy']} healthy" if across else f" on one rank, {totals['healthy']} without a finding")
              + f", {failing} failing"
              + (f", {totals['warned']} with warnings" if totals["warned"] else "")
              + (f" ({totals['not_kept']} not kept: TPPROBE_MAX_BYTES)" if totals["not_kept"] else ""),
              highlight=False, soft_wrap=True)
    if acc is not None:
        con.print(f"  engine acceptance: {summary(acc)}", highlight=False, soft_wrap=True)
    for r in rows:
        f = r["first"] or {}
        con.print(f"  step {r['step']} ({r['forward_mode']}) in {r['group']}: {f.get('kind')} at {f.get('where')} on "
                  f"ranks {f.get('ranks')}" + (" (record not kept)" if r.get("not_kept") else ""),
                  highlight=False, soft_wrap=True)
    for n in notes:
        con.print(f"  note: {n}", highlight=False, soft_wrap=True)
    con.print(("HEALTHY: every checked forward agreed on every rank, fully covered"
               + (" (the one-rank group noted above aside)" if one_rank else "") if across else
               NOT_CHECKED_ONE_RANK + f"each of the {totals['healthy']} checked forward(s) ran on a single rank, and "
               f"its own checks found nothing (no value is NaN or Inf)")
              if not failing and not totals["warned"] and not low else
              "NOT HEALTHY: the engine's acceptance is low and the draft's input was not checked (note above)"
              if not failing and not totals["warned"] else
              "NOT HEALTHY: checked forwards with warnings (notes above)" if not failing else
              "FAILING: the first failing step's report follows" if first and not quiet else "FAILING",
              highlight=False, soft_wrap=True)
    if first and not quiet:
        emit(probe_report(first[2]), None, Flags(json_out=False, html=None, markdown=None, quiet=False))
    return code


def engine_acceptance(dirs: list[Path]) -> Optional[dict]:
    """The engine's acceptance the plugin wrote beside the watch (vLLM's, else SGLang's), from the first folder
    that holds it (the node of the engine's scheduler)."""
    from ..formats.acceptance import read_all
    for d in dirs:
        for source in ("vllm-plugin", "sglang-plugin"):
            acc = read_all(d, source)
            if acc and "drafts" in acc:
                return {**acc, "engine": acc.get("engine") or ("vLLM" if source == "vllm-plugin" else "SGLang")}
    return None


def main_dirs(dirs: list[Path]) -> Optional[list[Path]]:
    """The folders as a watch run, or None when they are one ordinary capture (the one-folder report)."""
    if len(dirs) > 1 or is_watch_dir(dirs[0]):
        return dirs
    return None
