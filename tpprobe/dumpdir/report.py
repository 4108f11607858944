"""Dumper reports printed: `tpprobe report DUMPDIR` and `tpprobe diff B T` on the terminal or as JSON.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from .check import report_data
from .check import span as _span
from .diff import diff_data
from .dims import emit_dims_text
from ..checks.findings import FAILURE
from ..core.errors import CaptureError
from ..formats.sglang_dump import EXPECTED, tp_layout


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
