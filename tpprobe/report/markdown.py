"""`--markdown PATH`: a compact summary to paste into a GitHub issue (verdict, table, environment).

Always under 60 lines: the verdict lines come first, the table keeps every capture point that is
not bitwise on every rank plus as many of the others as fit, and the rest is one line each.
"""
from __future__ import annotations

from pathlib import Path

from .envinfo import env_lines
from .labels import cell_label, coverage_text, verdict_items

MAX_LINES = 59
ICON = {"failure": "🔴", "warning": "🟡", "info": "🔵", "ok": "🟢"}
LEVEL_MARK = {"material": "**", "shape": "**", "incomplete": "**"}


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _cell(s) -> str:
    txt = _md(cell_label(s))
    mark = LEVEL_MARK.get((s or {}).get("level"), "")
    return f"{mark}{txt}{mark}"


def render_markdown(report: dict) -> str:
    st = report.get("settings") or {}
    world = int(st.get("world_size") or 1)
    head = [f"### tpprobe rank-diff: {st.get('model')} · tp={world} · {st.get('backend')} · {st.get('dtype')} · "
            f"ids {st.get('layer_ids')}", ""]
    verdict = ["**Verdict**", ""]
    items = verdict_items(report)
    for f in items[:8]:
        verdict.append(f"- {ICON.get(f.get('severity'), '')} `{_md(f['line'])}`")
    if len(items) > 8:
        verdict.append(f"- … {len(items) - 8} more findings in report.json")
    verdict.append("")
    cov = coverage_text(report)
    if cov:
        verdict += [f"Coverage: {_md(cov)}.", ""]
    from .labels import audit_text, missing_allreduces, slot_values_differ
    ar = report.get("allreduce") or {}
    tail = []
    if ar:
        tail.append(f"All-reduce audit: {audit_text(ar, missing_allreduces(report))}.")
    slots = report.get("slots") or []
    if slots:
        bad = [s for s in slots if not s.get("ok")]
        tail.append(f"Aux slots: {len(slots) - len(bad)}/{len(slots)} hold the expected layer"
                    + ("; " + "; ".join(f"slot {s['slot']} holds {s['matched']} (expected {s['expected']})"
                                        for s in bad[:3])
                       if bad else "")
                    + "".join(f"; slot {s['slot']}'s values differ on ranks {d}"
                              for s in slots for d in [slot_values_differ(report, s)] if d) + ".")
    tail += ["", "<details><summary>Environment</summary>", ""]
    tail += [f"- {_md(l)}" for l in env_lines(report)]
    env = report.get("environment") or {}
    if env.get("platform"):
        tail.append(f"- {_md(env['platform'])}")
    tail += [f"- settings: tokens={st.get('tokens')} hidden={st.get('hidden')} layers={st.get('num_layers')} "
             f"seed={st.get('seed')} exchange={st.get('exchange')} inject={','.join(st.get('inject') or []) or '-'}",
             "", "</details>", "",
             f"<sub>{_md(report.get('tool', 'tpprobe'))} · exit code {report.get('exit_code', '?')}</sub>"]

    points = report.get("points") or []
    missing = set(report.get("ranks_missing") or [])
    budget = MAX_LINES - len(head) - len(verdict) - len(tail) - 5
    interesting = [p for p in points if p.get("level") not in ("bitwise", "share", "exact")]
    keep = set(id(p) for p in interesting[:max(budget, 0)])
    for p in points:
        if len(keep) >= budget:
            break
        keep.add(id(p))
    table = ["| capture point | " + " | ".join(f"rank {r}" for r in range(world)) + " |",
             "|---|" + "---|" * world]
    for p in points:
        if id(p) not in keep:
            continue
        row = []
        for r in range(world):
            s = (p.get("per_rank") or {}).get(str(r))
            row.append(_cell(s) if s else ("missing" if r in missing else "—"))
        table.append(f"| `{_md(p['name'])}` | " + " | ".join(row) + " |")
    dropped = len(points) - len(keep)
    if dropped > 0:
        rest = [p for p in points if id(p) not in keep]
        quiet = all(p.get("level") in ("bitwise", "share", "exact") for p in rest)
        table += ["", f"_{dropped} more capture points{', all bitwise or own shares' if quiet else ''}: "
                      f"see the HTML report or report.json_"]
    table.append("")
    lines = head + verdict + table + tail
    return "\n".join(lines[:MAX_LINES]) + "\n"


def write_markdown(report: dict, path: Path) -> None:
    from ..formats.capture_dir import atomic_write_bytes
    from ..formats.capture_dir import make_file_folder
    path = Path(path)
    make_file_folder(path, "--markdown")
    atomic_write_bytes(path, render_markdown(report).encode("utf-8"))
