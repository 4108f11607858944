"""`tpprobe accept`'s report as the shared Report (report/model.py): its sections, for the one sink
(report/emit.py: terminal or --json, --html, --markdown)."""
from __future__ import annotations


def _on(rep: dict) -> str:
    """` on cuda:0 (NVIDIA H200)` off the CPU; nothing on it (the CPU header reads as before)."""
    dev = rep.get("device", "cpu")
    return "" if dev == "cpu" else f" on {dev}" + (f" ({rep['device_name']})" if rep.get("device_name") else "")


def accept_report(rep: dict):
    """`tpprobe accept` as the shared Report: the accept-length table, unusable sources, the verdict."""
    import json

    from ...report.model import Cell, Column, Report, Table, Text
    d = rep["draft"]
    head = (f" — draft {d['path']} ({d['architecture']}, {d['aux_slots']} slots × {d['target_hidden']}, vocab map "
            f"{d['vocab_map']}) · engine {rep['engine']}{_on(rep)} · {rep['tokens']} tokens from {rep['tokens_from']}")
    ks = rep["chain_lengths"]
    rows = []
    for r in rep["rows"]:
        if not r["usable"]:
            rows.append([r["label"], "–", *["1.00"] * len(ks)])
        else:
            rows.append([r["label"], f"{r['top1_agreement']:.1%}", *[f"{r['accept_length'][str(k)]:.2f}" for k in ks]])
    word = "OK" if rep["ok"] else "COST"
    level = "ok" if rep["ok"] else "failure"
    sections: list = [
        Text(parts=[Cell("tpprobe accept", style="bold"), Cell(head)]),
        Table("expected accept length for a chain of k drafted tokens (1 + accepted drafts)"
              + (f", every k over the same {rep['chain_starts']} start positions (those where a chain of {max(ks)} "
                 f"fits)" if "chain_starts" in rep else ""),
              [Column("source"), Column("top-1 agreement", justify="right")]
              + [Column(f"k={k}", justify="right") for k in ks], rows)]
    sections += [Text(f"  {r['label']}: {r['why']}") for r in rep["rows"] if not r["usable"]]
    sections += [Text(parts=[Cell(word, level, "green" if rep["ok"] else "bold red"), Cell(f": {rep['line']}")]),
                 Text(f"how: {rep['estimate']}", style="dim")]
    return Report("tpprobe.accept/1", f"tpprobe accept: {word}", rep, verdict=[Cell(f"{word}: {rep['line']}", level)],
                  sections=sections, exit_code=rep["exit_code"], to_json=lambda x: json.dumps(x, indent=1))
