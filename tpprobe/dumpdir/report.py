"""Dumper reports: `tpprobe report DUMPDIR` and `tpprobe diff B T` as the shared Report (its sections), for the
one sink (report/emit.py: terminal or --json, --html, --markdown); --emit-dims prints the comparator's dims."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from .check import rank_words, report_data
from .check import span as _span
from .diff import diff_data
from .dims import emit_dims_text
from ..checks.findings import FAILURE
from ..core.errors import CaptureError
from ..formats.sglang_dump import EXPECTED, tp_layout


# ---- the shared Report (report/model.py): sections for the one sink ----------------------------------------
def report_sections(data: dict):
    """`tpprobe report DUMPDIR` as the shared Report: records × ranks, coverage, the verdict."""
    from ..report.words import cell_label
    from ..report.model import Cell, Column, Report, Rule, Table, Text
    cov = data["coverage"]
    steps = _span(data["steps"]) if data["steps"] else "-"
    head = f"{data['path']} · tp={data['tp_size']} · {len(data['ranks'])} ranks · steps {steps}"
    rows = []
    for rec in data["records"]:
        extra = "".join(f" {k}={v}" for k, v in rec["tags"].items())
        row = [rec["name"] + extra, str(rec["step"]), f"{rec['shape']} {rec['dtype']}",
               rec["read"] + (" (declared)" if rec["declared_dims"] and rec["read"] in ("partial", "sharded")
                              and tp_layout(rec["declared_dims"]) and tp_layout(rec["declared_dims"])[0] == rec["read"]
                              else "")]
        for r in data["ranks"]:
            s = rec["per_rank"].get(str(r))
            row.append(Cell(cell_label(s), (s or {}).get("level", "?")) if s else Cell("—", style="dim"))
        rows.append(row)
    sections: list = [
        Rule("tpprobe dumper report", f" — {head}"),
        Table("records × ranks", [Column(c, no_wrap=True) for c in ("name", "step", "shape", "read")]
              + [Column(f"rank {r}") for r in data["ranks"]], rows, terminal={"header_style": "bold"}),
        Text(f"coverage: {cov['files']} files, {cov['records_read']} read, {cov['groups']} records over "
             f"{cov['names']} names, " + _checked(cov)
             + (f"; not tensors (skipped): {', '.join(cov['not_tensors'][:4])}" if cov["not_tensors"] else ""),
             style="dim"),
        Text("verdict", style="bold", heading=True)]
    verdict = []
    for f in data["findings"]:
        sections.append(Text(f"  {f['line']}", f["severity"], soft_wrap=True))
        verdict.append(Cell(f["line"], f["severity"]))
        if f["severity"] != "info" and f.get("explain"):
            sections.append(Text(f"    why: {f['explain']}", style="dim", soft_wrap=True))
    if not any(f["severity"] != "info" for f in data["findings"]) and not cov["across_ranks"]:
        # one rank's files: no record had a peer, so nothing agrees or disagrees across ranks (exit 0: what
        # could be checked passed); `tpprobe diff` compares such a folder with another run
        line = (f"NOT CHECKED ACROSS RANKS: the folder holds the files of {_one_rank(data)} only, so no record was "
                f"compared with another rank; its {cov['checked']} records were read and hold no NaN or Inf "
                f"(`tpprobe diff {data['path']} OTHER` compares them with another run)")
        sections.append(Text(f"  {line}", "info", "bold cyan"))
        verdict.insert(0, Cell(line, "info"))
    elif not any(f["severity"] != "info" for f in data["findings"]):
        line = (f"HEALTHY: all {cov['checked']} records agree across ranks or are declared/identified "
                f"shards ({cov['records_read']} rank records read)")
        sections.append(Text(f"  {line}", "ok", "bold green"))
        verdict.insert(0, Cell(line, "ok"))
    doc = _public(data)
    return Report(doc.get("schema", "tpprobe.dumper-report/1"), f"tpprobe dumper report: {head}", doc, verdict=verdict,
                  sections=sections, findings=data["findings"], exit_code=data["exit_code"])


def _checked(cov: dict) -> str:
    """`12 checked across ranks`, or how many were, where not every record had another rank's to compare."""
    if cov["across_ranks"] == cov["checked"]:
        return f"{cov['checked']} checked across ranks"
    return f"{cov['checked']} checked, {cov['across_ranks'] or 'none'} of them across ranks"


def _one_rank(data: dict) -> str:
    return f"{rank_words(data['ranks'])} (tp {data['tp_size']})"


def diff_sections(data: dict):
    """`tpprobe diff B T` on two dumper folders as the shared Report: every record against the baseline."""
    from ..report.model import Cell, Column, Report, Table, Text
    sections: list = [Text(f"baseline: {data['baseline']}", style="dim"),
                      Text(f"target:   {data['target']}", style="dim")]
    sections += [Text(f"tokens:   {n}", style="dim", soft_wrap=True) for n in data["notes"]]
    cols = ("name", "step", "shape", "baseline", "target", "level", "max abs", "rel diff²", "ULP max")
    rows = [[r["name"], str(r["step"]), f"{r['shape']} {r['dtype']}", r["baseline_how"], r["target_how"],
             Cell(r["level"], r["level"]),
             "–" if r.get("max_abs") is None else f"{r['max_abs']:.3g}",
             "–" if r.get("rel_diff") is None else f"{r['rel_diff']:.2e}",
             "–" if r.get("ulp_max") is None else f"{r['ulp_max']:g}"] for r in data["rows"]]
    sections.append(Table(None, [Column(c, no_wrap=c not in ("baseline", "target")) for c in cols], rows,
                          terminal={"header_style": "bold"}))
    inferred = [r["name"] for r in data["rows"] if r["inferred"]]
    if inferred:
        sections.append(Text(f"unsharded by inference (the meta has no tp dims for them): "
                             f"{', '.join(sorted(set(inferred)))}", "warning", soft_wrap=True))
    verdict = []
    for f in data["findings"]:
        sections.append(Text(f"  {f['line']}", f["severity"], soft_wrap=True))
        verdict.append(Cell(f["line"], f["severity"]))
    if not any(f["severity"] == FAILURE for f in data["findings"]):
        lv = Counter(r["level"] for r in data["rows"])
        line = (f"MATCH: all {len(data['rows'])} records equal the baseline after unsharding "
                f"({lv.get('bitwise', 0)} bitwise, {lv.get('noise', 0)} within rounding)")
        sections.append(Text(line, "ok", "bold green"))
        verdict.insert(0, Cell(line, "ok"))
    return Report(data.get("schema", "tpprobe.dumper-diff/1"), f"tpprobe diff: {data['target']} against "
                  f"{data['baseline']}", data, verdict=verdict, sections=sections, findings=data["findings"],
                  exit_code=data["exit_code"])


def report_command(path: Path, json_out: bool = False, quiet: bool = False, emit_dims: bool = False,
                   html: Optional[str] = None, markdown: Optional[str] = None) -> int:
    data = report_data(path)
    if data["coverage"]["checked"] == 0:
        raise CaptureError(f"{data['path']}: no tensor records to check; expected {EXPECTED}")
    if emit_dims:      # the dims are what was asked for: written, exit 0; the findings are named on stderr
        sys.stdout.write(emit_dims_text(data))
        if data["exit_code"]:
            print(f"tpprobe: the dims were written; the dump also has findings: `tpprobe report {path}` "
                  f"names them", file=sys.stderr)
        return 0
    from ..report.emit import Flags, emit
    emit(report_sections(data), None, Flags(json_out=json_out, html=html, markdown=markdown, quiet=quiet))
    return data["exit_code"]


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def diff_command(baseline: Path, target: Path, json_out: bool = False, html: Optional[str] = None,
                 markdown: Optional[str] = None) -> int:
    data = diff_data(baseline, target)
    from ..report.emit import Flags, emit
    emit(diff_sections(data), None, Flags(json_out=json_out, html=html, markdown=markdown))
    return data["exit_code"]
