"""The terminal renderer: the report dict drawn with rich (rank 0 only).

`render(report, console)` draws into any rich Console; `console()` is the terminal's.
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .labels import (audit_text, cell_label, coverage_parts, coverage_text, missing_allreduces, slot_values_differ,
                     timing_text, verdict_lines)

LEVEL_STYLE = {"bitwise": "green", "exact": "green", "reference": "cyan", "noise": "yellow",
               "material": "bold red", "shape": "bold red", "incomplete": "bold red", "unchecked": "dim",
               "share": "dim"}


def console(stderr: bool = False) -> Console:
    # the progress display (rank 0) ends before anything is rendered to the terminal
    from .live import stop_all
    stop_all()
    # rich follows the terminal's capabilities and NO_COLOR by itself
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def error_line(msg: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(f"tpprobe: error: {msg}", style="bold red"))


def _cell(s: dict) -> Text:
    return Text(cell_label(s), style=LEVEL_STYLE.get(s.get("level", "?"), ""))


def render(report: dict, con: Console) -> None:
    st = report["settings"]
    con.rule(f"[bold]tpprobe rank-diff[/] — {st.get('model')} · tp={st['world_size']} · {st.get('backend')} · "
             f"{st.get('dtype')} · ids {st.get('layer_ids')}")
    from .envinfo import env_line
    con.print(Text(env_line(report), style="dim"))
    world = st["world_size"]
    t = Table(title="capture points × ranks", show_lines=False, header_style="bold")
    t.add_column("capture point")
    for r in range(world):
        t.add_column(f"rank {r}")
    for p in report["points"]:
        row = [p["name"]]
        for r in range(world):
            s = p["per_rank"].get(str(r))
            row.append(_cell(s) if s else Text("missing" if r in report["ranks_missing"] else "—", style="dim"))
        t.add_row(*row)
    con.print(t)
    cov = coverage_text(report)
    if cov:
        bad = any(b for _, _, b in coverage_parts(report))
        con.print(Text("coverage: " + cov, style="bold red" if bad else ""))
    ar = report["allreduce"]
    if ar:
        con.print(Text("all-reduce audit: " + audit_text(ar, missing_allreduces(report)),
                       style="bold red" if ar.get("incomplete") or missing_allreduces(report) else ""))
    if report.get("slots"):
        s = Table(title="aux slots (what the draft model receives)", header_style="bold")
        for c in ("slot", "id", "expected", "holds", "values across ranks"):
            s.add_column(c)
        for row in report["slots"]:
            differ = slot_values_differ(report, row)
            s.add_row(str(row["slot"]), str(row["id"]), str(row["expected"]),
                      Text(str(row["matched"]), style="green" if row["ok"] else "bold red"),
                      Text(f"differ on ranks {differ}" if differ else "agree",
                           style="bold red" if differ else "green"))
        con.print(s)
    if st.get("arch") in ("llama", "deepseek_v2", "qwen3", "qwen3_moe", "qwen2") and st.get("layer_ids") is not None \
            and not str(st.get("backend", "")).startswith("vllm"):     # SGLang's rule, not vLLM's
        # what SGLang's own capture rules make of these ids on this architecture
        from ..engines.sglang.layer_ids import layers_table, plan
        try:
            con.print(layers_table(plan(st["arch"], list(st["layer_ids"]), int(st["num_layers"]))))
        except Exception as e:   # a table is a courtesy: never let it break the report
            con.print(Text(f"(layer-id table unavailable: {e})", style="dim"))
    con.print(Text("verdict", style="bold"))
    for f in report["findings"]:
        style = {"failure": "bold red", "warning": "yellow", "info": "cyan"}[f["severity"]]
        con.print(Text(f"  {f['line']}", style=style))
        if f["severity"] != "info" and f.get("explain"):
            con.print(Text(f"    why: {f['explain']}", style="dim"))
        for c in f.get("consequences", [])[:5]:
            con.print(Text(f"    follows from it: {c}", style="dim"))
    if not report["findings"]:
        con.print(Text("  " + verdict_lines(report)[0], style="bold green"))
    con.print(Text(f"settings: tokens={st.get('tokens')} hidden={st.get('hidden')} layers={st.get('num_layers')} "
                   f"seed={st.get('seed')} exchange={st.get('exchange')} inject={st.get('inject') or '-'}  "
                   + timing_text(report), style="dim"))
    if report.get("out"):
        wrote = (report.get("exchange") or {}).get("captured_bytes_per_rank")
        con.print(Text(f"captures and report.json: {report['out']}"
                       + (f" ({wrote / 1e6:.2f} MB per rank)" if wrote else ""), style="dim"))

