"""`tpprobe report DIR` over a run of many steps (the SGLang and vLLM plugins' step folders).

The plugins (SGLang's, vLLM's) write DIR/dp{D}-pp{P}/step-{N:06d}-{mode}/ (one capture folder per TP
group and forward, N the forward index, mode its forward mode: extend, decode, ...); folders written
before the mode was in the name, DIR/dp{D}-pp{P}/step-{N:06d}/, are read as well (their mode from
the capture's settings, if any). Every step folder is checked as `tpprobe report` checks one; the
report printed is the FIRST step, in forward order, whose ranks diverge (any failure finding), with
the step, its forward mode and the TP group named in its settings and a one-line summary of every
step checked (`steps` in --json). When no step fails, the last step's report is printed with the
count of steps checked, all healthy.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from ..core.errors import UsageError
from ..probe.report import probe_report
from ..report.emit import Flags, emit

_STEP = re.compile(r"^step-(\d+)(?:-([a-z0-9_]+))?$")   # the mode part: absent in old folders


def find_steps(root: Path) -> list[tuple[str, int, Path]]:
    """(TP group folder relative to root, forward index, step folder), in (index, group) order;
    `step-N-mode` and the old `step-N` folders alike."""
    out = []
    for m in root.rglob("manifest.json"):
        hit = _STEP.match(m.parent.name)
        if hit:
            group = m.parent.parent.relative_to(root).as_posix()
            out.append(("." if group == "." else group, int(hit.group(1)), m.parent))
    return sorted(out, key=lambda x: (x[1], x[0], x[2].name))


def manifests_of(steps: list) -> dict:
    """Each step folder's manifest, read once (tpprobe.formats.capture_dir.read_manifest): {folder: manifest, or
    None when it cannot be read (its check then says why)}."""
    from ..core.errors import CaptureError
    from ..formats.capture_dir import read_manifest
    out = {}
    for _, _, path in steps:
        try:
            out[path] = read_manifest(path)
        except CaptureError:
            out[path] = None
    return out


def latest_run(steps: list, manifests: dict) -> tuple[list, list]:
    """(the steps of each TP group's latest server, the others as (group, N, folder, server run)): a plugin writes
    each step's server ("server run" in its settings: the first capture's time, host and pid of the group's TP
    rank 0); a folder an earlier server wrote into too holds steps of both. Steps without it (older captures) are
    kept. `manifests`: manifests_of(steps)."""
    run_of = {path: ((manifests.get(path) or {}).get("settings") or {}).get("server run") for _, _, path in steps}
    newest: dict = {}
    for group, _, path in steps:
        r = run_of[path]
        if r is not None and (newest.get(group) is None or r > newest[group]):
            newest[group] = r
    keep = [x for x in steps if run_of[x[2]] is None or run_of[x[2]] == newest.get(x[0])]
    return keep, [(g, n, p, run_of[p]) for g, n, p in steps if (g, n, p) not in keep]


def folder_mode(path: Path) -> Optional[str]:
    """The forward mode a step folder's name carries (`step-000003-decode`: decode); None for an old
    `step-N` folder."""
    hit = _STEP.match(path.name)
    return hit.group(2) if hit else None


def report_steps(root: Path, check_dir: Callable[[Path], dict], json_out: bool = False,
                 html: Optional[str] = None, markdown: Optional[str] = None, quiet: bool = False) -> int:
    """check_dir(step folder, its manifest or None) -> that step's report (cli/report.py's, passed in: no import
    cycle)."""

    steps = find_steps(root)
    if not steps:
        raise UsageError(f"{root} holds no step-N-MODE/manifest.json capture folders: point tpprobe report at a "
                         f"folder written by the SGLang or vLLM plugin (TPPROBE_CAPTURE_DIR) or by tpprobe probe")
    manifests = manifests_of(steps)       # read once: for the server of each step, then for its checks
    steps, stale = latest_run(steps, manifests)
    rows, first, last = [], None, None
    for group, n, path in steps:
        rep = check_dir(path, manifests[path])
        fails = [f for f in rep["findings"] if f["severity"] == "failure"]
        st = rep["settings"]
        if not st.get("forward_mode") and folder_mode(path):     # a capture without it in its settings
            st = rep["settings"] = {**st, "forward_mode": folder_mode(path)}
        rows.append({"group": group, "step": n, "forward_mode": st.get("forward_mode"), "folder": str(path),
                     "failures": len(fails), "points": len(rep["points"]),
                     "first": f"{fails[0]['kind']} at {fails[0]['where']} on ranks {fails[0]['ranks']}" if fails
                     else None})
        if fails and first is None:
            first = (group, n, rep)
        last = (group, n, rep)
    group, n, rep = first or last
    fails = [r for r in rows if r["failures"]]
    rep["settings"] = {**rep["settings"], "steps checked": f"{len(rows)} in {len({r['group'] for r in rows})} "
                                                            f"TP group(s), {len(fails)} with failures",
                       "step shown": f"{n} ({rep['settings'].get('forward_mode', '?')}) in {group}"
                                     + (" = the first step where ranks diverge" if first else "")}
    rep["steps"] = rows
    if stale:
        # an earlier server wrote into the same folder: its steps are not this run's, and are not reported
        from ..checks.findings import WARNING, Finding, exit_code
        names = [f"{g}/{p.name}" for g, _, p, _ in stale]
        runs = sorted({r for _, _, _, r in stale})
        rep["findings"] = [Finding("capture-file", "the capture folder", [], severity=WARNING, detail=(
            f"{len(stale)} step folder(s) ({', '.join(names[:4])}{' …' if len(names) > 4 else ''}) were written by an "
            f"earlier server ({'; '.join(runs[:2])}) than the latest steps ({rep['settings'].get('server run')}): "
            f"this report is of the latest server's steps only; move the others away, or give each server its own "
            f"TPPROBE_CAPTURE_DIR")).to_json(), *rep["findings"]]
        rep["exit_code"] = exit_code(rep["findings"])
        rep["stale_steps"] = [{"folder": str(p), "server run": r} for _, _, p, r in stale]
    from ..formats.acceptance import attach
    attach(rep, root)       # the engine's own acceptance, when the plugin wrote it
    if first:
        f0 = next(f for f in rep["findings"] if f["severity"] == "failure")
        rep["first_divergence"] = {"group": group, "step": n, "forward_mode": rep["settings"].get("forward_mode"),
                                   "kind": f0["kind"], "where": f0["where"], "ranks": f0["ranks"]}
    rep["out"] = str(root)
    from .drafter import add_drafter
    add_drafter(root, rep)        # a live vLLM capture with an EAGLE-3 drafter: its input and vLLM's acceptance
    from .drafter import add_sglang_replay
    add_sglang_replay(root, rep)  # an SGLang capture of the draft's input: the draft replayed for candidate ids
    if not json_out and not quiet:
        from ..report.emit import console
        d = rep.get("first_divergence")
        console().print(f"tpprobe report over {len(rows)} step(s) in {len({r['group'] for r in rows})} TP group(s) "
                        f"of {root}: " + (f"first divergence: step {d['step']} ({d['forward_mode']}) in {d['group']}: "
                                          f"{d['kind']} at {d['where']} on ranks {d['ranks']}; "
                                          f"{len(fails)} step(s) with failures; that step's report follows"
                                          if d else "no step's ranks diverge" + (
                                              "; the EAGLE-3 drafter's input fails its checks (its section below)"
                                              if any(f["severity"] == "failure" for f in (rep.get("drafter") or {})
                                                     .get("findings") or []) else "")
                                          + "; the last step's report follows"),
                        highlight=False, soft_wrap=True)
    emit(probe_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown, quiet=quiet))
    return rep["exit_code"]
