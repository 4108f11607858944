"""Every command the README shows, and what tests/test_readme.py does with it.

`python scripts/readme_commands.py` lists them: each shell line of a ```bash block and each inline
`tpprobe …` / `PYTHONPATH=. tpprobe …` / `bash …` / `pip …` command, with its class:

  run     tests/test_readme.py runs it as written, in a fresh bash with the venv activated
          (the sweep tier runs the costly ones: `bash scripts/test.sh -m sweep`)
  skip    not run, with the reason (installs, GPUs, a live server, placeholders like DIR)

A command no rule classifies fails the test: a new README command needs a decision here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

PLACEHOLDERS = re.compile(r"\b(DUMPDIR|B_DUMPDIR|T_DUMPDIR|DRAFT|DIR|BASELINE|TARGET|CAPTURE|OUT\.ckpt|NAME|"
                          r"COMMAND|N|F)\b|pkg\.module|\[|\|")

# (pattern, class, cost, reason); first match wins. cost: "fast" runs in the default tier, "slow" in sweep
RULES = [
    (r"^python3 -m venv \.venv", "skip", "", "the set-up line: scripts/test.sh does the same install in CI"),
    (r"^\. \.venv/bin/activate$", "skip", "", "the activation every other command runs after"),
    (r"^pip install ", "skip", "", "an install (scripts/test.sh installs in CI; the CPU index needs the network)"),
    (r"^bash scripts/test\.sh", "skip", "", "the whole test suite (CI runs it)"),
    (r"^bash ci/sglang-cpu/install\.sh", "skip", "", "installs the SGLang CPU tier (scripts/test.sh runs it)"),
    (r"^bash ci/tp-libs/install\.sh", "skip", "", "installs the TP-libraries tier (scripts/test.sh runs it)"),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.(dtensor_llama|hf_tp|megatron_gpt):build --nproc 2$", "skip", "",
     "tests/test_tp_libs.py runs it as written in the default tier and checks its report's coverage"),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.(dtensor_llama|hf_tp|megatron_gpt):build(_sequence_parallel)? "
     r"--nproc [24]$",
     "run", "slow", ""),
    (r"^bash scripts/screenshot\.sh", "skip", "", "needs chromium; tests/test_reports.py renders the page"),
    (r"^pytest -m gpu", "skip", "", "needs a GPU"),
    (r"^python scripts/fault_table\.py", "skip", "", "regenerates the fault table (tests/test_faults.py checks it)"),
    (r"^python scripts/layout\.py", "skip", "", "regenerates the README's layout (tests/test_house.py checks it)"),
    (r"--backend sglang", "skip", "", "SGLang's real models: tests/test_sglang_probe.py runs them"),
    (r"^TPPROBE_CAPTURE_DIR=\S+ .*vllm serve |^tpprobe report /tmp/cap$", "skip", "",
     "a live vLLM server: tests/test_vllm_live.py runs vLLM's engine with the plugin under -m vllm_live"),
    (r"^bash ci/vllm-cpu/install\.sh|^\.venv-vllm/|--backend vllm", "skip", "",
     "the vLLM tier (its own venv; scripts/test.sh installs it and runs tests/test_vllm_*.py under -m vllm)"),
    (r"^python scripts/import_graph\.py$", "run", "fast", ""),
    (r"^block .*: tpprobe (probe|specforge|diff) ", "run", "fast", ""),
    (r"^tpprobe probe --inject [a-z-]+(@\d+)?( --\S+ \S+)*$", "run", "slow", ""),
    (r"^tpprobe torchrun ", "run", "slow", ""),
    (r"^tpprobe invariance --tp [\d,]+ --batch [\d,]+$", "run", "slow", ""),
    (r"^python -m examples\.accept_toy_draft$", "run", "slow", ""),
    (r"^tpprobe accept$", "skip", "",
     "the command's name in prose; tests/test_accept.py and examples/accept_toy_draft.py run it"),
    (r"^tpprobe (layers|--version)\b", "run", "fast", ""),
    (r"^tpprobe probe$", "run", "fast", ""),
    (r"^PYTHONPATH=\. tpprobe probe --model examples\.my_model:build", "run", "slow",
     ""),   # fast tier: tests/test_cli.py
    (r"^(tpprobe|python) ", "skip-if-placeholder", "", "a template with placeholders (DIR, N, …), not a command"),
]


@dataclass
class Command:
    text: str
    where: str          # "block N" (commands of one block run in order, in one folder) or "inline"
    cls: str = ""
    cost: str = ""
    reason: str = ""


def _classify(c: Command) -> Command:
    for pat, cls, cost, reason in RULES:
        subject = f"{c.where}: {c.text}" if pat.startswith("^block") else c.text
        if re.search(pat, subject):
            if cls == "skip-if-placeholder":
                if PLACEHOLDERS.search(c.text):
                    c.cls, c.reason = "skip", reason
                    return c
                continue
            c.cls, c.cost, c.reason = cls, cost, reason
            return c
    c.cls = "unclassified"
    return c


def commands(text: str | None = None) -> list[Command]:
    text = README.read_text() if text is None else text
    out: list[Command] = []
    for i, block in enumerate(re.findall(r"```bash\n(.*?)```", text, re.S)):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(_classify(Command(line, f"block {i}")))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    seen = {c.text for c in out}
    for span in re.findall(r"`([^`\n]+)`", prose):
        span = span.strip()
        if re.match(r"(tpprobe |PYTHONPATH=\. tpprobe |bash |pip |pytest |python scripts/|python -m examples\.|\. "
                    r"\.venv)", span) \
                and span not in seen:
            seen.add(span)
            out.append(_classify(Command(span, "inline")))
    return out


if __name__ == "__main__":
    for c in commands():
        print(f"{c.cls:13} {c.cost:5} {c.text}" + (f"   ({c.reason})" if c.reason else ""))
