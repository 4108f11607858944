"""The commands the README and the docs pages show run as written, what they are shown printing is what
they print, and the README's numbers are sourced. Prose is free to change; a command, an output or a
number that stops being true fails here.

- Every command (scripts/readme_commands.py finds and classifies them; one it cannot classify fails)
  runs in a fresh bash with only the venv activated (`. .venv/bin/activate`, as the README says), in a
  scratch folder that holds the checkout's files; the default tier runs the cheap ones, the sweep tier
  (`-m sweep`) the rest. Its exit code is 0 unless EXPECTED_EXIT says otherwise, and stderr holds no
  traceback.
- A block marked as showing its output (`<!-- output of the block above ... -->` then a text block)
  prints exactly that, whitespace aside.
- A benchmark command is too long to run here: its script exists and defines every flag it passes.
- A measured number in the README's prose (a value with a unit, a percentage, a power of ten) stands in
  an output it shows or in a docs page it links to: the README carries no number of its own.

docs/faults.md's table, docs/report.md's annotated report, the variables' tables and the layout are
generated from real runs or the code, and checked by tests/ranks/test_faults.py, test_annotated_report.py,
test_knobs.py and test_house.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_commands as rc  # noqa: E402

VENV = Path(sys.executable).parent.parent      # the venv running the tests: the README's .venv
EXPECTED_EXIT = [(r"--inject skip-allreduce@2", 1),
                 (r"^tpprobe diff tpprobe-runs/train tpprobe-runs/serve$", 1),      # the slots are shifted
                 (r"^tpprobe layers --arch deepseek_v2 --ids -1,2,30", 1),         # its table shows a crash
                 (r"^tpprobe layers --draft-config examples/eagle3", 1),           # the example's contract differs
                 (r"^tpprobe layers --target-config examples/eagle3", 1),          # id -1 crashes on that target
                 (r"^python -m examples\.accept_toy_draft$", 1),                   # the broken capture costs
                 (r"^tpprobe invariance --tp 1,2,4 --batch 1,3,8( --out tpprobe-runs/default .*)?$", 1),  # not bitwise
                 (r"^tpprobe invariance --tp 1,4 --batch 1,3,8 --reduce ordered --switch-above", 1)]  # the switch
EXPECTED_OUT = {  # a fragment the command prints, where no output block shows it (whitespace-normalised)
    "tpprobe probe --inject skip-allreduce@2": "FAILURE partial-allreduce at layer 2 (layers.2.self_attn.o_proj) (all "
                                               "ranks)",
    "tpprobe --version": "tpprobe 0.1.0",
    "tpprobe invariance --tp 1,2,4 --batch 1,3,8": "bitwise equality breaks at the collective of "
                                                   "layers.0.self_attn.o_proj",
    "PYTHONPATH=. tpprobe probe --model examples.my_model:build --layers 0,1": "HEALTHY",
    **{f"PYTHONPATH=. tpprobe probe --model examples.{m} --nproc {n}": "HEALTHY" for m, n in (
        ("dtensor_llama:build_sequence_parallel", 4), ("megatron_gpt:build_sequence_parallel", 4))},
    "tpprobe layers --ids -1,2,30 --num-layers 61": "layer.30.out",
    "tpprobe layers --draft-config examples/eagle3/draft_config.json "
    "--target-config examples/eagle3/target_config.json":
        "FAILURE id-contract (capture-offset at aux slot 0)",
}


def _installed_here() -> bool:
    """Does the venv's own tpprobe come from this checkout (as after the README's `pip install -e .`)?"""
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", "import tpprobe; print(tpprobe.__file__)"],
                         capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"}).stdout
    return out.strip().startswith(str(ROOT / "tpprobe"))


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """run(cmd, cwd) -> CompletedProcess: a fresh bash, nothing inherited but HOME and a plain PATH."""
    assert (VENV / "bin" / "activate").is_file(), f"no venv at {VENV}"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "LANG": "C.UTF-8", "TERM": "dumb"}
    if not _installed_here():     # a worktree whose venv installed another checkout: point it here
        env["PYTHONPATH"] = str(ROOT)

    def folder(name: str) -> Path:
        d = tmp_path_factory.mktemp(name)
        for entry in ROOT.iterdir():          # the checkout's files, as in a clone; outputs stay here
            if entry.name not in (".git", "tpprobe-runs", ".venv") and not entry.name.startswith("."):
                (d / entry.name).symlink_to(entry)
        return d

    def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "--noprofile", "--norc", "-c", f". {VENV}/bin/activate && {cmd}"],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    run.folder = folder
    return run


def _words(text: str) -> str:
    return " ".join(text.split())


def _check(c: rc.Command, p: subprocess.CompletedProcess) -> None:
    want = next((code for pat, code in EXPECTED_EXIT if re.search(pat, c.text)), 0)
    assert p.returncode == want, \
        f"{c.where}: {c.text}: exit {p.returncode}, the page says {want}\n{p.stdout[-1500:]}{p.stderr[-1500:]}"
    assert "Traceback" not in p.stderr and "error" not in p.stderr.lower(), (c.text, p.stderr[-1500:])
    if c.text in EXPECTED_OUT:
        assert EXPECTED_OUT[c.text] in _words(p.stdout), (c.text, p.stdout[-1500:])


def test_every_command_in_the_readme_and_docs_is_classified():
    cmds = rc.commands()
    assert [f"{c.where}: {c.text}" for c in cmds if c.cls == "unclassified"] == []
    assert any(c.cls == "run" and c.cost == "fast" for c in cmds)


def test_the_readme_shows_the_set_up_the_test_suite_and_the_seeds_problem_with_its_output():
    """The front door's three promises, as commands (not as sentences): the set-up line, the whole test suite,
    and a block of commands shown with what it prints."""
    readme = [c for c in rc.commands() if c.where.startswith("README.md")]
    texts = [c.text for c in readme]
    assert any(t.startswith("python3 -m venv .venv") and t.endswith("tpprobe probe") for t in texts), texts
    assert "bash scripts/test.sh" in texts
    assert any(c.shown and c.cls == "run" for c in readme)
    assert len(rc.README.read_text().splitlines()) <= 200


def _groups(cost: str) -> list[list[rc.Command]]:
    """Commands to run, a block's commands together (in order, in one folder); one an inline command
    shown on several pages runs once."""
    groups: dict[str, list] = {}
    for c in rc.commands():
        if c.cls == "run" and c.cost == cost:
            key = c.where if not c.where.endswith("inline") else c.text
            if c.where.endswith("inline") or c.text not in {x.text for x in groups.get(key, [])}:
                groups.setdefault(key, []).append(c)
    return list(groups.values())


def _params():
    """Every runnable group; the costly ones in the sweep tier."""
    return [pytest.param(g, id=f"{g[0].where.split()[0]}: {g[0].text[:50]}",
                         marks=[pytest.mark.sweep] if cost == "slow" else [])
            for cost in ("fast", "slow") for g in _groups(cost)]


@pytest.mark.parametrize("group", _params())
def test_command_runs_as_written(group, shell):
    d = shell.folder("docs")
    printed = []
    for c in group:
        p = shell(c.text, d)
        _check(c, p)
        printed.append(p.stdout)
    shown = group[0].shown
    if shown is not None:
        assert _words("".join(printed)) == _words(shown), \
            f"{group[0].where}: the output shown is not what the block prints; it prints:\n{''.join(printed)}"


def test_every_benchmark_command_names_a_script_and_flags_that_exist():
    bad = []
    for c in rc.commands():
        if c.cls != "flags":
            continue
        script, flags = rc.bench_flags(c)
        if not script.is_file():
            bad.append(f"{c.where}: {c.text}: no {script.relative_to(ROOT)}")
            continue
        src = script.read_text()
        # flags a bench shares are defined in the bench module it imports them from (bench/decode_setup.py)
        src += "".join((script.parent / f"{m}.py").read_text() for m in re.findall(r"from bench\.(\w+) import", src)
                       if (script.parent / f"{m}.py").is_file())
        bad += [f"{c.where}: {c.text}: {script.name} defines no {f}" for f in flags
                if not re.search(r"[\"']" + re.escape(f) + r"[\"']", src)]
    assert bad == []


NUMBER = re.compile(r"(?<![\w.−-])(\d+(?:\.\d+)?(?:\s?(?:%|×|ms|µs|min|MB|GB|KB|KiB|s)(?!\w))|\d(?:\.\d+)?e[+-]?\d+)")


def test_the_readmes_numbers_stand_in_what_it_shows_or_links():
    text = rc.README.read_text()
    shown = " ".join(re.findall(r"```text\n(.*?)```", text, re.S))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    linked = [ROOT / m for m in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", prose) if (ROOT / m).is_file()]
    sources = _words(shown + " ".join(p.read_text() for p in linked))
    numbers = {_words(n) for n in NUMBER.findall(prose)}
    assert numbers, "the scan finds the README's numbers"
    assert sorted(n for n in numbers if n not in sources) == []
