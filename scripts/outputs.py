"""Record what a set of tpprobe commands print, and compare two recordings: the house moves' proof that
terminal and --json output did not change (byte-identical after timings are masked).

    PYTHONPATH=. .venv/bin/python scripts/outputs.py record /tmp/before      # on the old tree
    PYTHONPATH=. .venv/bin/python scripts/outputs.py record /tmp/before layers invariance   # only these
    PYTHONPATH=. .venv/bin/python scripts/outputs.py record /tmp/after       # on the new tree
    python scripts/outputs.py compare /tmp/before /tmp/after                 # exit 1 on any difference

Each command's stdout, stderr and exit code go to DIR/<name>.txt; timings, durations, the run's folder
and the environment block (versions, hostname) are masked, nothing else. Every command writes under DIR
and runs from the root of the tree PYTHONPATH picks (its relative paths, examples/..., are that tree's).
"""
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

# name -> tpprobe arguments ({d} is the recording's folder)
COMMANDS = {
    "help": ["--help"],
    "help-probe": ["probe", "--help"],
    "help-report": ["report", "--help"],
    "help-diff": ["diff", "--help"],
    "help-layers": ["layers", "--help"],
    "help-invariance": ["invariance", "--help"],
    "help-accept": ["accept", "--help"],
    "help-specforge": ["specforge", "--help"],
    "probe-healthy": ["probe", "--out", "{d}/healthy"],
    "probe-healthy-json": ["probe", "--json", "--out", "{d}/healthy-j"],
    "probe-skip": ["probe", "--inject", "skip-allreduce@2", "--out", "{d}/skip"],
    "probe-skip-json": ["probe", "--json", "--inject", "skip-allreduce@2", "--out", "{d}/skip-j"],
    "probe-scaled-fp": ["probe", "--exchange", "fingerprint", "--inject", "allreduce-scaled@1", "--out", "{d}/scaled"],
    "probe-tp4-aux": ["probe", "--nproc", "4", "--layers", "0,2,4", "--out", "{d}/tp4"],
    "report-text": ["report", "{d}/skip"],
    "report-json": ["report", "--json", "{d}/skip"],
    "report-md": ["report", "{d}/skip", "--markdown", "{d}/skip.md"],
    "report-html": ["report", "{d}/healthy", "--html", "{d}/healthy.html"],
    "diff-self": ["diff", "{d}/healthy", "{d}/skip"],
    "layers": ["layers", "--arch", "llama", "--num-layers", "8"],
    "layers-json": ["layers", "--arch", "deepseek_v3", "--num-layers", "61", "--ids", "2,30,58", "--json"],
    "bad-usage": ["probe", "--nproc", "0"],
    # one report model, one sink: the other commands' terminal and --json
    "diff-self-json": ["diff", "--json", "{d}/healthy", "{d}/skip"],
    "probe-sglang": ["probe", "--engine", "sglang", "--arch", "llama", "--out", "{d}/sglang"],
    # the old spelling of --engine: the same run, one warning line more on stderr
    "probe-sglang-backend": ["probe", "--backend", "sglang", "--arch", "llama", "--out", "{d}/sglang-b"],
    "layers-all": ["layers", "--arch", "all", "--num-layers", "8"],
    "layers-all-json": ["layers", "--arch", "all", "--num-layers", "8", "--json"],
    "layers-crash": ["layers", "--arch", "llama", "--num-layers", "8", "--ids", "2,30"],
    "layers-contract": ["layers", "--draft-config", "examples/eagle3/draft_config.json",
                        "--target-config", "examples/eagle3/target_config.json"],
    "layers-contract-json": ["layers", "--draft-config", "examples/eagle3/draft_config.json",
                             "--target-config", "examples/eagle3/target_config.json", "--json"],
    "invariance": ["invariance", "--tp", "1,2", "--batch", "1,3", "--out", "{d}/inv"],
    "invariance-json": ["invariance", "--json", "--tp", "1,2", "--batch", "1,3", "--out", "{d}/inv-j"],
    # the rest of the commands: torchrun, specforge, and a toy draft's accept and fix
    "torchrun": ["torchrun", "--nproc-per-node", "2", "probe", "--out", "{d}/torchrun"],
    "specforge": ["specforge", "{d}/healthy", "{d}/healthy.ckpt"],
    "accept-toy": ["@examples.accept_toy_draft", "{d}/acc"],      # @: a module the tree ships, run with -m
    "accept": ["accept", "--draft", "{d}/acc/draft", "--baseline", "{d}/acc/healthy", "--target", "{d}/acc/slot-order",
               "--fix"],
    "accept-json": ["accept", "--json", "--draft", "{d}/acc/draft", "--baseline", "{d}/acc/healthy", "--target",
                    "{d}/acc/slot-order", "--fix"],
    "fix": ["fix", "--draft", "{d}/acc/draft", "--streams", "{d}/acc/healthy", "--engine", "sglang", "--arch", "llama"],
    "fix-json": ["fix", "--json", "--draft", "{d}/acc/draft", "--streams", "{d}/acc/slot-order", "--engine", "sglang",
                 "--arch", "llama"],
}

MASKS = [
    (re.compile(r"\b\d+(\.\d+)?\s?(ms|s|µs|us)\b"), "…s"),
    (re.compile(r"\"(wall|elapsed|seconds|time|sent|received|[a-z_]*_s|[a-z_]*_ms|[a-z_]*_mb)\": [0-9.e+-]+"),
     r'"\1": …'),
    (re.compile(r"\"(hostname|host|python|torch|tpprobe|platform|cpu|pid|created|started|date)\": \"[^\"]*\""),
     r'"\1": …'),
    # the size of files that hold timings varies by a few bytes from run to run
    (re.compile(r"\"([a-z_]*bytes[a-z_]*)\": [0-9]+"), r'"\1": …'),
]


def mask(text: str, d: str = "") -> str:
    if d:
        text = text.replace(d, "{d}")
    for pat, rep in MASKS:
        text = pat.sub(rep, text)
    return text


def record(d: Path, names: list[str]) -> None:
    """Every command, or only those named (a recording made in parts: later cases read earlier folders)."""
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, COLUMNS="120", NO_COLOR="1", TERM="dumb")
    # the commands run from the root of the tree recorded: their relative paths (examples/...) are that tree's
    tree = subprocess.run([sys.executable, "-P", "-c", "import os, tpprobe; print(os.path.dirname(os.path.dirname("
                           "tpprobe.__file__)))"], capture_output=True, text=True, env=env, check=True).stdout.strip()
    for name, args in COMMANDS.items():
        if names and name not in names:
            continue
        # -P: the current folder is not put before PYTHONPATH, so PYTHONPATH picks the tree recorded even when
        # this runs from another checkout (python -m would otherwise import ./tpprobe first)
        head = [args[0][1:]] if args[0].startswith("@") else ["tpprobe", args[0]]
        argv = [sys.executable, "-P", "-m", *head] + [a.format(d=d) for a in args[1:]]
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=tree)
        out = f"exit {p.returncode}\n--- stdout\n{p.stdout}--- stderr\n{p.stderr}"
        (d / f"{name}.txt").write_text(mask(out, str(d)).replace(tree, "{tree}"))
        print(f"{name}: exit {p.returncode}")


def compare(a: Path, b: Path) -> int:
    bad = 0
    names = [n for n in COMMANDS if (a / f"{n}.txt").exists() and (b / f"{n}.txt").exists()]
    for d in (a, b):        # a recording older than a case, or one made in parts, has none for it
        missing = [n for n in COMMANDS if not (d / f"{n}.txt").exists()]
        if missing:
            print(f"not recorded in {d}: {', '.join(missing)}")
    for name in names:
        # masked again: a recording made before a mask was added compares under it too
        x, y = mask((a / f"{name}.txt").read_text()), mask((b / f"{name}.txt").read_text())
        if x != y:
            bad += 1
            sys.stdout.writelines(difflib.unified_diff(x.splitlines(True), y.splitlines(True), f"{a}/{name}",
                                                       f"{b}/{name}"))
    print(f"{len(names) - bad} of {len(names)} identical")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]).resolve(), sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit("usage: outputs.py record DIR [NAME ...] | compare BEFORE AFTER")
