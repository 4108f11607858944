"""The annotated report of docs/report.md, from a real run: `tpprobe probe --inject skip-allreduce@2` in a
scratch folder, its terminal output as printed (120 columns, as on any pipe), with what varies
from run to run or machine to machine replaced by `…` (timings, the run folder, the versions and
machine line) and the notes (`← ...`) added to the lines they explain.

  python scripts/annotated_report.py            # print it
  python scripts/annotated_report.py --write    # replace docs/report.md's block (between the markers)

tests/house/test_annotated_report.py runs it and fails when the page's block differs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_section  # noqa: E402
PAGE = ROOT / "docs" / "report.md"
COMMAND = ["probe", "--inject", "skip-allreduce@2"]
BEGIN, END = "<!-- annotated:begin (python scripts/annotated_report.py --write) -->", "<!-- annotated:end -->"
# a line that starts with (or, for "~", contains) the key gets the note
NOTES = [
    ("│ embed.local ", "each rank's vocab shard before the reduce: differs by design"),
    ("│ embed.out ", "the embedding is all-reduced: identical on every rank"),
    ("│ layer.2.out ", "first divergence (max abs diff 2.6)"),
    ("~the all-reduce of layers.2.self_attn.o_proj", "12, not 13: this one is missing on every rank"),
    ("│ 2    │ 3 ", "the right layer, but its values are wrong"),
    ("    follows from it: layer.2.out", "grouped under the root, not separate failures"),
]


def run() -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "COLUMNS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as d:
        cp = subprocess.run([sys.executable, "-m", "tpprobe", *COMMAND], cwd=d, env=env, capture_output=True,
                            text=True, timeout=300)
    assert cp.returncode == 1, cp.stderr[-3000:]
    return cp.stdout


def annotate(out: str) -> str:
    lines = out.rstrip("\n").splitlines()
    # the versions-and-machine line (and its wrap): what this report says about where it ran
    for i, ln in enumerate(lines):
        if ln.startswith("tpprobe ") and " · torch " in ln:
            end = i + 1 if ln.rstrip().endswith("|") or "ranks/node" not in ln else i + 2
            lines[i:end] = [ln.split(" · torch ")[0] + " · torch … · python …  |  backend gloo · world 2 · …"]
            break
    text = "\n".join(ln.rstrip() for ln in lines)
    text = re.sub(r"\b\d+\.\d+s\b", "…s", text)
    text = re.sub(r"tpprobe-runs/[0-9]{8}-[0-9]{6}-[0-9a-f]{4}", "tpprobe-runs/…", text)
    out_lines = []
    for ln in text.splitlines():
        for key, note in NOTES:
            if (key[1:] in ln) if key.startswith("~") else ln.startswith(key):
                ln = f"{ln}   ← {note}"
                break
        out_lines.append(ln)
    return "\n".join(out_lines)


def block(text: str) -> str:
    return f"`tpprobe {' '.join(COMMAND)}` (the o_proj all-reduce of layer 2 never runs):\n\n```text\n{text}\n```"


def page_block(readme: str) -> str:
    return readme_section.section(readme, BEGIN, END)


if __name__ == "__main__":
    got = block(annotate(run()))
    if "--write" in sys.argv:
        readme_section.write(BEGIN, END, got, PAGE)
    else:
        print(got)
