"""One report model, one sink: every command writes --html FILE and --markdown FILE the
same way, each holding the command's verdict line and its table rows; the HTML is one self-contained file.

Real runs only: two probe captures (healthy and a skipped all-reduce) feed probe, report and diff; one
invariance grid; layers needs no run. Each command runs as a user runs it (a subprocess, `python -m tpprobe`).
"""
from __future__ import annotations

import html as htmllib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "eagle3"


def tpprobe(args: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), NO_COLOR="1",
               COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "tpprobe", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def files(d: Path, name: str) -> list:
    return ["--html", d / f"{name}.html", "--markdown", d / f"{name}.md"]


def assert_written(d: Path, name: str, verdict: str, rows: list[list[str]]) -> tuple[str, str]:
    """Both files exist, hold the verdict line and every given row's cells (in order, in one table row);
    the HTML loads nothing from outside itself."""
    page, md = (d / f"{name}.html").read_text(), (d / f"{name}.md").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>"), page[:200]
    assert not re.search(r"<script|<link|<iframe|\b(src|href)=\"(https?:)?//", page), "the HTML must be self-contained"
    text = htmllib.unescape(re.sub(r"<[^>]+>", " ", page))
    assert verdict in text, (verdict, text[:3000])
    assert verdict.replace("|", "\\|") in md, (verdict, md)
    trs = [htmllib.unescape(re.sub(r"<[^>]+>", "\t", tr)) for tr in re.findall(r"<tr>.*?</tr>", page, re.S)]
    md_rows = [ln for ln in md.splitlines() if ln.startswith("|")]
    for row in rows:
        assert any(all(c in tr for c in row) and _ordered(tr, row) for tr in trs), (row, trs[:20])
        assert any(_ordered(ln.replace("\\|", "|"), row) for ln in md_rows), (row, md_rows[:20])
    return page, md


def _ordered(line: str, cells: list[str]) -> bool:
    at = 0
    for c in cells:
        at = line.find(c, at)
        if at < 0:
            return False
        at += len(c)
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sinks")
    healthy = tpprobe(["probe", "--out", d / "healthy", *files(d, "probe-healthy")], d)
    skip = tpprobe(["probe", "--inject", "skip-allreduce@2", "--out", d / "skip", *files(d, "probe-skip")], d)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert skip.returncode == 1, skip.stdout + skip.stderr
    return {"dir": d, "healthy": healthy, "skip": skip}


def test_probe_and_report_write_both_files(runs):
    d = runs["dir"]
    doc = json.loads((d / "skip" / "report.json").read_text())
    first = doc["findings"][0]["line"]
    assert f"HTML report: {d / 'probe-skip.html'}" in runs["skip"].stdout
    assert_written(d, "probe-skip", first, [["layer.2.out"]])
    rep = tpprobe(["report", d / "skip", *files(d, "report")], d)
    assert rep.returncode == 1, rep.stderr
    assert_written(d, "report", first, [["layer.2.out"]])


def test_diff_writes_both_files(runs):
    d = runs["dir"]
    p = tpprobe(["diff", d / "healthy", d / "skip", *files(d, "diff")], d)
    assert p.returncode == 1, p.stdout + p.stderr
    j = json.loads(tpprobe(["diff", "--json", d / "healthy", d / "skip"], d).stdout)
    res = j["results"][0]
    assert not res["ok"]
    row = res["rows"][-1]
    cells = [f"{row['target_slot']}→{row['baseline_slot']}"]
    page, md = assert_written(d, "diff", res["verdict"], [cells])
    assert f"HTML report: {d / 'diff.html'}" in p.stdout
    # stdout stays pure JSON with the files asked for: where they went is said on stderr
    pj = tpprobe(["diff", "--json", d / "healthy", d / "skip", *files(d, "diff-j")], d)
    assert json.loads(pj.stdout) == j and f"Markdown summary: {d / 'diff-j.md'}" in pj.stderr
    assert (d / "diff-j.html").read_text() == page


def test_layers_writes_both_files_for_an_arch_every_arch_and_the_contract(tmp_path):
    p = tpprobe(["layers", "--arch", "llama", "--num-layers", "8", "--ids", "2,7", *files(tmp_path, "one")], tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(tpprobe(["layers", "--arch", "llama", "--num-layers", "8", "--ids", "2,7", "--json"],
                             tmp_path).stdout)
    r0 = doc["rows"][0]
    assert_written(tmp_path, "one", f"PROBLEM: {doc['problems'][0]}",
                   [[str(r0["requested"]), str(r0["layer"]), "layer.2.out"]])

    p = tpprobe(["layers", "--arch", "all", "--num-layers", "8", *files(tmp_path, "all")], tmp_path)
    rows = json.loads(tpprobe(["layers", "--arch", "all", "--num-layers", "8", "--json"], tmp_path).stdout)
    # every architecture's default ids are usable; one rule lives outside SGLang's code and is not checked
    assert p.returncode == 0 and not any(r["problems"] for r in rows), p.stdout[-2000:]
    assert [r["arch"] for r in rows if r["outside"]] == ["MindSporeForCausalLM"]
    ok = next(r for r in rows if not r["outside"])
    verdict = (f"every architecture checked captures one usable slot per id ({len(rows) - 1} of {len(rows)} "
               f"architectures; not checked: MindSporeForCausalLM")
    assert_written(tmp_path, "all", verdict, [[ok["arch"], ok["file"], str(ok["layers_to_capture"])]])

    args = ["layers", "--draft-config", EXAMPLES / "draft_config.json", "--target-config",
            EXAMPLES / "target_config.json"]
    p = tpprobe(args + files(tmp_path, "contract"), tmp_path)
    res = json.loads(tpprobe(args + ["--json"], tmp_path).stdout)
    assert p.returncode == 1 and res["differences"]
    bad = next(r for r in res["rows"] if not r["ok"])
    _, md = assert_written(tmp_path, "contract", "; ".join(res["differences"]),
                           [[str(bad["slot"]), str(bad["draft_id"]), bad["draft_expects"], "DIFFERS"]])
    assert "**DIFFERS**" in md


def test_invariance_writes_both_files(tmp_path):
    p = tpprobe(["invariance", "--tp", "1,2", "--batch", "1,3", "--out", tmp_path / "inv",
                 *files(tmp_path, "inv")], tmp_path, timeout=600)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    doc = json.loads((tmp_path / "inv" / "report.json").read_text())
    from tpprobe.invariance.render import cell_text, row_label
    names = [x["name"] for x in doc["configs"]]
    rows = [[row_label(e)] + [cell_text(e["cells"][n]) for n in names] for e in doc["rows"][:3]]
    assert_written(tmp_path, "inv", doc["verdict"]["line"], rows)
    assert f"HTML report: {tmp_path / 'inv.html'}" in p.stdout


def test_layers_writes_both_files_for_vllms_rule(tmp_path):
    args = ["layers", "--engine", "vllm", "--arch", "llama", "--num-layers", "8", "--ids", "2,7,9"]
    p = tpprobe(args + files(tmp_path, "vllm"), tmp_path)
    doc = json.loads(tpprobe(args + ["--json"], tmp_path).stdout)
    assert p.returncode == (1 if doc["problems"] else 0), p.stdout + p.stderr
    r0 = doc["rows"][0]
    verdict = (f"PROBLEM: {doc['problems'][0]}" if doc["problems"] else
               f"every id captures one slot the draft can use: aux slots = HF hidden_states{doc['slots']}")
    assert_written(tmp_path, "vllm", verdict, [[str(r0["requested"]), "-" if r0["slot"] is None else str(r0["slot"])]])
