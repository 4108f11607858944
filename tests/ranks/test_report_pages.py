"""The HTML and Markdown pages of a healthy run say what was measured and nothing else: no `None` for
what was not recorded, no call for matplotlib when there is no difference to draw, and the capture
points that are bitwise on every rank folded into one line (the table is for what differs).

The run is real (the CLI, 2 gloo ranks); the pages are rendered from its report as `tpprobe report`
renders them. Where matplotlib's absence matters, the page is rendered in a fresh interpreter in which
`import matplotlib` fails, as it does where the html extra is not installed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import ROOT, probe


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pages") / "run"
    code, _, cp = probe(out, "--num-layers", "12", "--layers", "-1,1,3")
    assert code == 0, cp.stderr[-2000:]
    from tpprobe.cli.report import check_dir
    return out, check_dir(out)


def test_the_html_leaves_out_what_was_not_recorded(healthy):
    from tpprobe.probe.report import render_html
    out, doc = healthy
    env = doc["environment"]
    unrecorded = [k for k, v in env.items() if v is None]
    assert "ranks_per_node" in unrecorded          # an offline report of a launcher run: not known here
    page = render_html(doc)
    assert not re.search(r"<td>None</td>", page)
    envsec = page[page.index('<section id="environment">'):]
    envsec = envsec[:envsec.index("</section>")]
    assert "<th>torch</th>" in envsec
    for k in unrecorded:
        assert f"<th>{k}</th>" not in envsec
    assert f"<th>world_size</th><td>{doc['settings']['world_size']}</td>" in page   # the settings' own, kept


def test_no_difference_asks_for_no_matplotlib(healthy, tmp_path):
    _, doc = healthy
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    code = ("import json, sys\nsys.modules['matplotlib'] = None\nfrom tpprobe.probe.report import render_html\n"
            "print(render_html(json.load(open(sys.argv[1]))))\n")
    cp = subprocess.run([sys.executable, "-c", code, str(tmp_path / "doc.json")], capture_output=True, text=True,
                        cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    page = cp.stdout
    assert "matplotlib" not in page and "missing-heatmaps" not in page
    assert "every compared capture point is bitwise equal on every rank" in page
    # a run where a rank differs still says what is missing to draw it
    bad = json.loads(json.dumps(doc))
    p = next(p for p in bad["points"] if p["name"] == "layer.3.out")
    p["per_rank"]["1"]["heat"] = [0.5] * len(p["per_rank"]["1"]["heat"])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    cp = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad.json")], capture_output=True, text=True,
                        cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert cp.returncode == 0 and "per-token heatmaps need matplotlib" in cp.stdout, cp.stderr[-2000:]


def test_the_markdown_folds_every_bitwise_point_into_one_line(healthy):
    from tpprobe.probe.report import render_markdown
    _, doc = healthy
    names = [p["name"] for p in doc["points"]]
    assert len(names) >= 16 and all(p["level"] in ("bitwise", "share", "exact") for p in doc["points"])
    md = render_markdown(doc)
    assert "| capture point |" not in md                  # no table of rows that all say "bitwise"
    line = next(ln for ln in md.splitlines() if "capture points, all bitwise or own shares" in ln)
    assert line.startswith(f"{len(names)} capture points, all bitwise or own shares: `{names[0]}`")
    assert all(f"`{n}`" in line for n in names)
    assert len(md.splitlines()) < 30
