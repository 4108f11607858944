"""`tpprobe accept`'s report printed: the terminal table and the Markdown summary."""
from __future__ import annotations


def _on(rep: dict) -> str:
    """` on cuda:0 (NVIDIA H200)` off the CPU; nothing on it (the CPU header reads as before)."""
    dev = rep.get("device", "cpu")
    return "" if dev == "cpu" else f" on {dev}" + (f" ({rep['device_name']})" if rep.get("device_name") else "")


def render(rep: dict, console) -> None:
    from rich.table import Table
    d = rep["draft"]
    console.print(f"[bold]tpprobe accept[/] — draft {d['path']} ({d['architecture']}, {d['aux_slots']} slots × "
                  f"{d['target_hidden']}, vocab map {d['vocab_map']}) · engine {rep['engine']}{_on(rep)} · "
                  f"{rep['tokens']} tokens from {rep['tokens_from']}")
    tab = Table(title="expected accept length for a chain of k drafted tokens (1 + accepted drafts)")
    tab.add_column("source")
    tab.add_column("top-1 agreement", justify="right")
    for k in rep["chain_lengths"]:
        tab.add_column(f"k={k}", justify="right")
    for r in rep["rows"]:
        if not r["usable"]:
            tab.add_row(r["label"], "–", *["1.00"] * len(rep["chain_lengths"]))
            continue
        tab.add_row(r["label"], f"{r['top1_agreement']:.1%}",
                    *[f"{r['accept_length'][str(k)]:.2f}" for k in rep["chain_lengths"]])
    console.print(tab)
    for r in rep["rows"]:
        if not r["usable"]:
            console.print(f"  {r['label']}: {r['why']}")
    style = "green" if rep["ok"] else "bold red"
    console.print(f"[{style}]{'OK' if rep['ok'] else 'COST'}[/]: {rep['line']}")
    console.print(f"[dim]how: {rep['estimate']}[/]")


def markdown(rep: dict) -> str:
    ks = rep["chain_lengths"]
    lines = [f"### tpprobe accept: {'OK' if rep['ok'] else 'COST'}", "", rep["line"], "",
             f"draft `{rep['draft']['path']}` · engine {rep['engine']}{_on(rep)} · {rep['tokens']} tokens", "",
             "| source | top-1 | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|---:|" + "---:|" * len(ks)]
    for r in rep["rows"]:
        if r["usable"]:
            lines.append(f"| {r['label']} | {r['top1_agreement']:.1%} | "
                         + " | ".join(f"{r['accept_length'][str(k)]:.2f}" for k in ks) + " |")
        else:
            lines.append(f"| {r['label']} | unusable | " + " | ".join("1.00" for _ in ks) + " |")
    lines += ["", f"_{rep['estimate']}_", ""]
    return "\n".join(lines)
