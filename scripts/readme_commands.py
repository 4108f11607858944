"""Every command the README and the docs pages show, and what tests/house/test_readme.py does with it.

`python scripts/readme_commands.py` lists them: each shell line of a ```bash block and each inline
`tpprobe …` / `PYTHONPATH=. tpprobe …` / `bash …` / `pip …` command of README.md and docs/*.md (the
dated records under docs/results/ are history, not instructions), with its class:

  run     tests/house/test_readme.py runs it as written, in a fresh bash with the venv activated
          (the sweep tier runs the costly ones: `bash scripts/test.sh -m sweep`)
  flags   a benchmark: too long for a test, so its script must exist and its `--help` name every
          flag the command passes
  skip    not run, with the reason (installs, GPUs, a live server, placeholders like DIR)

A command no rule classifies fails the test: a new README command needs a decision here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def pages() -> list[Path]:
    """The pages whose commands are checked: the README and every topic page of docs/."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]

PLACEHOLDERS = re.compile(r"\b(DUMPDIR|B_DUMPDIR|T_DUMPDIR|DRAFT|DIR|BASELINE|TARGET|CAPTURE|OUT\.ckpt|NAME|"
                          r"COMMAND|N|F|B|T|A|D|D\.json|T\.json)\b|pkg\.module|\.\.\.|\[|\|")

# (pattern, class, cost, reason); first match wins. cost: "fast" runs in the default tier, "slow" in sweep
RULES = [
    (r"^python3 -m venv \.venv", "skip", "", "the set-up line: scripts/test.sh does the same install in CI"),
    (r"^\. \.venv/bin/activate$", "skip", "", "the activation every other command runs after"),
    (r"^pip install ", "skip", "", "an install (scripts/test.sh installs in CI; the CPU index needs the network)"),
    (r"^bash scripts/test\.sh", "skip", "", "the whole test suite (CI runs it)"),
    (r"^bash ci/sglang-cpu/install\.sh", "skip", "", "installs the SGLang CPU tier (scripts/test.sh runs it)"),
    (r"^bash ci/tp-libs/install\.sh", "skip", "", "installs the TP-libraries tier (scripts/test.sh runs it)"),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.(dtensor_llama|hf_tp|megatron_gpt):build --nproc 2$", "skip", "",
     "tests/libs/test_tp_libs.py runs it as written in the default tier and checks its report's coverage"),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.(dtensor_llama|hf_tp|megatron_gpt):build(_sequence_parallel)? "
     r"--nproc [24]$",
     "run", "slow", ""),
    (r"^bash scripts/screenshot\.sh", "skip", "", "needs chromium; tests/ranks/test_reports.py renders the page"),
    (r"^pytest -m gpu", "skip", "", "needs a GPU"),
    (r"^python scripts/(fault_table|layout|annotated_report|knobs_table)\.py --write$", "skip", "",
     "regenerates a generated doc section (tests/ranks/test_faults.py and tests/house/: test_house.py, "
     "test_annotated_report.py, test_knobs.py check it)"),
    (r"^bash scripts/gpu\.sh", "skip", "", "needs a GPU (the GPU tier: docs/results/gpu.md)"),
    (r"^(python -m )?pytest ", "skip", "", "a test run: scripts/test.sh runs the suite"),
    (r"^(tpprobe (probe|report|diff|specforge|torchrun|invariance|accept|layers|fix)|pip install|pytest -s)$",
     "skip", "", "a command's name in prose"),
    (r"^(PYTHONPATH=\S+ )?(\S*python|bash) bench/", "flags", "", ""),
    (r"^POLARS=", "skip", "", "installs polars into a temp folder for bench/dumper_vs_comparator.py"),
    (r"^tpprobe invariance --tp [\d,]+ --batch [\d,]+ .*--out tpprobe-runs/\w+", "run", "slow", ""),
    (r"^tpprobe probe --exchange full( --tokens \d+)?$", "run", "fast", ""),
    (r"--engine sglang", "skip", "", "SGLang's real models: tests/engines/sglang/test_sglang_probe.py runs them"),
    (r"^TPPROBE_CAPTURE_DIR=\S+ .*vllm serve |^tpprobe report /tmp/cap(/dp0-pp0/step-\d+-\w+)?$", "skip", "",
     "a live vLLM server: tests/engines/vllm/test_vllm_live.py runs vLLM's engine with the plugin under -m vllm_live"),
    (r"^bash ci/vllm-cpu/install\.sh|^\.venv-vllm/|--engine vllm", "skip", "",
     "the vLLM tier (its own venv; scripts/test.sh installs it and runs tests/engines/vllm/ under -m vllm)"),
    (r"^python scripts/import_graph\.py$", "run", "fast", ""),
    (r"^block .*: tpprobe (probe|specforge|diff) ", "run", "fast", ""),
    (r"^tpprobe probe --inject [a-z-]+(@\d+)?( --\S+ \S+)*$", "run", "slow", ""),
    (r"^tpprobe torchrun ", "run", "slow", ""),
    (r"^tpprobe invariance --tp [\d,]+ --batch [\d,]+$", "run", "slow", ""),
    (r"^python -m examples\.accept_toy_draft$", "run", "slow", ""),
    (r"^tpprobe accept$", "skip", "",
     "the command's name in prose; tests/ranks/test_accept.py and examples/accept_toy_draft.py run it"),
    (r"^tpprobe fix$", "skip", "",
     "the command's name in prose; tests/ranks/test_fix.py runs it on a capture and a draft"),
    (r"^tpprobe (layers|--version)\b", "run", "fast", ""),
    (r"^tpprobe probe$", "run", "fast", ""),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.my_model:build", "run", "slow",
     ""),   # fast tier: tests/ranks/test_cli.py
    (r"^(tpprobe|python) ", "skip-if-placeholder", "", "a template with placeholders (DIR, N, …), not a command"),
]


def bench_flags(c: Command) -> tuple[Path, list[str]]:
    """A benchmark command's script and the flags it passes."""
    script = re.search(r"(bench/[\w./]+\.(?:py|sh))", c.text).group(1)
    return ROOT / script, re.findall(r"(?<!\S)(--[a-z][\w-]*)", c.text.split(script, 1)[1])


@dataclass
class Command:
    text: str
    where: str          # "PAGE block N" (commands of one block run in order, in one folder) or "PAGE inline"
    cls: str = ""
    cost: str = ""
    reason: str = ""
    shown: str | None = None   # what the page shows the block printing (a ```text block marked as its output)


OUTPUT_MARK = "<!-- output of the block above"


def _classify(c: Command) -> Command:
    for pat, cls, cost, reason in RULES:
        subject = f"{c.where.split()[-2]} {c.where.split()[-1]}: {c.text}" if pat.startswith("^block") else c.text
        if re.search(pat, subject):
            if cls == "skip-if-placeholder":
                if PLACEHOLDERS.search(c.text):
                    c.cls, c.reason = "skip", reason
                    return c
                continue
            c.cls, c.cost, c.reason = cls, cost, reason
            if cls == "run" and PLACEHOLDERS.search(c.text):
                c.cls, c.cost, c.reason = "skip", "", "a template with placeholders (DIR, N, …), not a command"
            return c
    c.cls = "unclassified"
    return c


def commands(text: str | None = None, page: str = "README.md") -> list[Command]:
    """Every command of one page (`text`), or of every page when no text is given."""
    if text is None:
        return [c for p in pages() for c in commands(p.read_text(), str(p.relative_to(ROOT)))]
    out: list[Command] = []
    shown_after = r"(\s*" + re.escape(OUTPUT_MARK) + r".*?-->\n```text\n(.*?)```)?"
    for i, m in enumerate(re.finditer(r"```bash\n(.*?)```\n" + shown_after, text, re.S)):
        for line in m.group(1).replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(_classify(Command(" ".join(line.split()), f"{page} block {i}", shown=m.group(3))))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    seen = {c.text for c in out}
    for span in re.findall(r"`([^`\n]+)`", prose):
        span = span.strip()
        if re.match(r"(tpprobe |PYTHONPATH=\. tpprobe |bash |pip |pytest |python scripts/|python -m examples\.|\. "
                    r"\.venv)", span) \
                and span not in seen:
            seen.add(span)
            out.append(_classify(Command(span, f"{page} inline")))
    return out


if __name__ == "__main__":
    for c in commands():
        print(f"{c.cls:13} {c.cost:5} {c.where.split()[0]:24} {c.text}" + (f"   ({c.reason})" if c.reason else ""))
