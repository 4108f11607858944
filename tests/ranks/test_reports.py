"""Reports people would rather look at: HTML, Markdown, environment header, progress.

One real faulty run (2 ranks, the all-reduce of layer 2's attention skipped) feeds every test;
the HTML is parsed (every cell and verdict present, images are matplotlib PNGs, nothing external),
and in CI Debian's chromium renders it headless (screenshot + the DOM text holds the verdict).
"""
from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tpprobe.report import envinfo
from tpprobe.report.words import cell_label
from tpprobe.probe.report import render_html, render_markdown, write_html

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium"
PNG_SIG = b"\x89PNG\r\n\x1a\n"


# ---- one real faulty run ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    d = tmp_path_factory.mktemp("faulty")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--inject", "skip-allreduce@2",
                        "--out", str(d / "run"), "--quiet", "--html", str(d / "report.html"),
                        "--markdown", str(d / "report.md")], cwd=d, env=env, capture_output=True,
                        text=True, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads((d / "run" / "report.json").read_text())
    assert report["findings"], "the injected fault must be found"
    return {"dir": d, "report": report, "html": (d / "report.html").read_text(), "md": (d / "report.md").read_text()}


# ---- HTML parsing helpers ---------------------------------------------------------------------
class Doc(HTMLParser):
    """Tables (class -> rows of (text, class)), images, every attribute, text with positions."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[tuple[str, str]]]] = {}
        self.imgs: list[dict] = []
        self.attrs: list[tuple[str, str, str]] = []
        self.text: list[str] = []
        self._table = None
        self._cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        if tag == "table":
            self._table = self.tables.setdefault(a.get("class", f"t{len(self.tables)}"), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = ["", a.get("class", "")]
        elif tag == "img":
            self.imgs.append(a)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table:
            self._table[-1].append((self._cell[0].strip(), self._cell[1]))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data
        self.text.append(data)

    @property
    def alltext(self) -> str:
        return re.sub(r"\s+", " ", " ".join(self.text))


def parse(html: str) -> Doc:
    d = Doc()
    d.feed(html)
    d.close()
    return d


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Decode a PNG's chunks, checking the signature and every CRC; the image data must inflate."""
    assert data[:8] == PNG_SIG, "not a PNG"
    out, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", data[i + 8 + n:i + 12 + n])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        out.append((kind, body))
        i += 12 + n
    kinds = [k for k, _ in out]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    w, h = struct.unpack(">II", out[0][1][:8])
    assert w > 0 and h > 0
    raw = zlib.decompress(b"".join(b for k, b in out if k == b"IDAT"))
    assert len(raw) >= h * w, "image data shorter than its size"
    return out


def png_size(data: bytes) -> tuple[int, int]:
    return struct.unpack(">II", data[16:24])


def heat_points(report: dict) -> list[dict]:
    return [p for p in report["points"] if any(s.get("heat") for s in p["per_rank"].values())]


# ---- HTML -------------------------------------------------------------------------------------
def test_html_verdict_first_and_every_cell(faulty):
    rep, html = faulty["report"], faulty["html"]
    doc = parse(html)
    text = doc.alltext
    for f in rep["findings"]:
        assert re.sub(r"\s+", " ", f["line"]) in text
    # the verdict comes before the table, the audit, the heatmaps, the environment
    pos = [html.index(f'id="{s}"') for s in ("verdict", "env-header", "points", "allreduce", "heatmaps", "settings",
                                             "environment")]
    assert pos == sorted(pos)
    rows = doc.tables["points"]
    world = rep["settings"]["world_size"]
    assert [c[0] for c in rows[0]] == ["capture point", "layer"] + [f"rank {r}" for r in range(world)]
    assert len(rows) - 1 == len(rep["points"])
    classes = {"bitwise": "ok", "reference": "ref", "noise": "noise", "material": "bad", "shape": "shape",
               "share": "dim"}
    for row, p in zip(rows[1:], rep["points"]):
        assert row[0][0] == p["name"]
        for r in range(world):
            s = p["per_rank"][str(r)]
            assert row[2 + r][0] == cell_label(s)
            assert row[2 + r][1] == classes[s["level"]], (p["name"], r, row[2 + r])
    assert any(c[1] == "bad" for row in rows[1:] for c in row), "a material cell must be coloured"
    # the all-reduce audit: one row per record, the summary numbers
    ar = rep["allreduce"]
    audit = doc.tables["allreduce"][1:]
    assert len(audit) == len(ar["records"]) + 1          # + the reduce that never ran, in its place
    gone = [i for i, row in enumerate(audit) if row[5][0] == "never issued"]
    assert len(gone) == 1 and audit[gone[0]][1][0] == "layer.2" and audit[gone[0]][2][0] == "layers.2.self_attn.o_proj"
    assert audit[gone[0]][5][1] == "bad" and audit[gone[0] - 1][1][0] == "layer.1" \
        and audit[gone[0] + 1][1][0] == "layer.2"
    assert f"{ar['checked']} all-reduces checked" in text \
        and "never issued: the all-reduce of layers.2.self_attn.o_proj" in text
    # aux slots: slot 2 holds the right layer (layer.3.out) but its values differ on rank 1: red, not green
    slots = doc.tables["slots"]
    assert len(slots) - 1 == len(rep["slots"])
    assert [c[0] for c in slots[0]] == ["slot", "id", "expected", "holds", "values across ranks"]
    assert [(r[3][1], r[4])
            for r in slots[1:]] == [("ok", ("agree", "ok"))] * 2 + [("bad", ("differ on ranks [1]", "bad"))]
    assert "skip-allreduce@2" in text
    env = rep["environment"]
    assert f"torch {env['torch']}" in text and "CPU" in text


def test_html_images_are_matplotlib_pngs(faulty):
    rep, doc = faulty["report"], parse(faulty["html"])
    assert len(doc.imgs) == len(heat_points(rep)) > 0
    for img in doc.imgs:
        src = img["src"]
        assert src.startswith("data:image/png;base64,")
        import base64
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        chunks = png_chunks(data)
        text = {b.split(b"\0", 1)[0]: b.split(b"\0", 1)[1] for k, b in chunks if k == b"tEXt"}
        assert b"matplotlib" in text.get(b"Software", b"").lower(), text


def test_html_has_nothing_external(faulty):
    html = faulty["html"]
    for bad in ("http:", "https:", "//cdn", "@import", "<script", "<link", "<iframe"):
        assert bad not in html.lower(), bad
    doc = parse(html)
    for tag, k, v in doc.attrs:
        if k in ("src", "href", "action", "poster", "srcset", "data"):
            assert v.startswith("data:"), (tag, k, v[:60])
    for m in re.finditer(r"url\(([^)]*)\)", html):
        assert m.group(1).strip("'\"").startswith("data:"), m.group(0)


def test_html_healthy_missing_rank_and_shape(faulty, tmp_path):
    rep = copy.deepcopy(faulty["report"])
    rep["findings"], rep["exit_code"] = [], 0
    rep["points"] = rep["points"][:3]      # (fewer heatmaps: images are tested above)
    doc = parse(render_html(rep))
    assert "HEALTHY" in doc.alltext
    # a rank that never reported, and a shape mismatch: cells say so, nothing raises
    rep = copy.deepcopy(faulty["report"])
    rep["ranks_missing"] = [1]
    rep["points"] = rep["points"][:4]
    for p in rep["points"]:
        p["per_rank"].pop("1", None)
    rep["points"][1]["per_rank"]["0"] = {"level": "shape", "shape": [3, 4]}
    write_html(rep, tmp_path / "sub" / "r.html")
    doc = parse((tmp_path / "sub" / "r.html").read_text())
    cells = [c for row in doc.tables["points"][1:] for c in row]
    assert ("missing", "dim") in cells and ("shape [3, 4]", "shape") in cells


# ---- Markdown -----------------------------------------------------------------------------------
def test_markdown_compact_with_verdict_table_environment(faulty):
    md, rep = faulty["md"], faulty["report"]
    lines = md.splitlines()
    assert len(lines) < 60
    for f in rep["findings"]:
        assert f["line"].replace("|", "\\|") in md
    assert lines[0].startswith("### tpprobe rank-diff")
    assert "| capture point | rank 0 | rank 1 |" in md
    for p in rep["points"]:
        assert f"`{p['name']}`" in md
    assert "**material" in md
    assert f"torch {rep['environment']['torch']}" in md and "CPU" in md


def test_markdown_stays_under_60_lines_for_big_reports(faulty):
    rep = copy.deepcopy(faulty["report"])
    pts = rep["points"]
    rep["points"] = [dict(pts[i % len(pts)], name=f"p{i}") for i in range(300)]
    rep["findings"] = rep["findings"] * 20
    md = render_markdown(rep)
    assert len(md.splitlines()) < 60
    assert rep["findings"][0]["line"] in md and "more capture points" in md and "</details>" in md


# ---- coverage (part of the verdict) in every renderer ------------------------------------------------
SKIP2_REDUCES = "layers 0–1: 2 on every rank; layer 2: 1 on every rank; layers 3–5: 2 on every rank"


def _terminal_text(rep: dict) -> str:
    from rich.console import Console

    from tpprobe.probe.report import render
    con = Console(record=True, width=400, color_system=None)
    render(rep, con)
    return re.sub(r"\s+", " ", con.export_text())


def test_coverage_in_html_and_markdown_of_a_real_run(faulty):
    rep, doc, md = faulty["report"], parse(faulty["html"]), faulty["md"]
    n = sum(rep["coverage"]["paths"].values())
    rows = {r[0][0]: r[1] for r in doc.tables["coverage"]}
    assert rows == {"embedding": ("embed_tokens (found by structure)", ""),
                    "decoder layers": ("6 of 6 hooked (structure: layers, TPDecoderLayer)", ""),
                    "reduces per layer and rank": (SKIP2_REDUCES, ""),
                    "through": (f"c10d.allreduce_ ×{n}", "")}, rows
    html = faulty["html"]
    assert html.index('id="verdict"') < html.index('id="coverage"') < html.index('id="points"')
    line = next(l for l in md.splitlines() if l.startswith("Coverage: "))
    assert line == (f"Coverage: embedding embed_tokens (found by structure) · decoder layers 6 of 6 hooked (structure: "
                    f"layers, TPDecoderLayer) · reduces per layer and rank: {SKIP2_REDUCES} · through c10d.allreduce_ "
                    f"×{n}.")
    assert f"coverage: {line[len('Coverage: '):-1]}" in _terminal_text(rep)


def test_coverage_with_a_missing_rank_says_per_layer_what_each_rank_issued(faulty):
    rep = copy.deepcopy(faulty["report"])
    rep["points"] = rep["points"][:2]      # (fewer heatmaps: images are tested above)
    rep["ranks_missing"] = [1]      # rank 1 never reported: its counts are not there
    for v in rep["coverage"]["reduces_per_place"].values():
        v.pop("1", None)
    rep["coverage"]["reduces_per_place"]["layer.4"] = {}
    want = ("layers 0–1: 2 on rank 0; layer 2: 1 on rank 0; layer 3: 2 on rank 0; layer 4: none; "
            "layer 5: 2 on rank 0; rank 1: no record")
    assert f"reduces per layer and rank: {want} · through" in _terminal_text(rep)
    assert f"reduces per layer and rank: {want} · through" in render_markdown(rep)
    rows = {r[0][0]: r[1] for r in parse(render_html(rep)).tables["coverage"]}
    assert rows["reduces per layer and rank"] == (want, "")
    # ranks that issued different counts at one layer: each count with its ranks
    rep["settings"]["world_size"], rep["ranks_missing"] = 4, [2]
    rep["coverage"]["reduces_per_place"] = {f"layer.{k}": {"0": 2, "1": 2 - (k == 3), "3": 2} for k in range(6)}
    rows = {r[0][0]: r[1] for r in parse(render_html(rep)).tables["coverage"]}
    assert rows["reduces per layer and rank"][0] == ("layers 0–2: 2 on each of ranks 0, 1, 3; layer 3: 2 on ranks 0, "
                                                     "3, "
                                                     "1 on rank 1; layers 4–5: 2 on each of ranks 0, 1, 3; rank 2: no "
                                                     "record")


# ---- environment ----------------------------------------------------------------------------------
def test_environment_on_cpu_never_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)      # nvidia-ml-py missing: still fine
    e = envinfo.environment()
    assert e["tpprobe"] and e["torch"] and e["devices"] == ["CPU"] and e["device"] == "CPU"
    assert envinfo._nvml(2)["nvml"].startswith("unavailable")
    lines = envinfo.env_lines({"environment": e, "settings": {"world_size": 2, "backend": "gloo"}})
    assert "CPU" in lines[1] and "world 2" in lines[1] and "torch" in lines[0]
    assert "CPU" in envinfo.env_line({"environment": e, "settings": {}})
    json.dumps(e)


def test_environment_nvml_that_fails_to_start(monkeypatch):
    class NV:
        def nvmlInit(self):
            raise RuntimeError("Driver Not Loaded")
    monkeypatch.setitem(sys.modules, "pynvml", NV())
    assert envinfo._nvml(2) == {"nvml": "unavailable: Driver Not Loaded"}


class FakeNVML:
    """Two GPUs joined by 18 NVLinks, a third one across the SMP interconnect."""
    NVML_FEATURE_ENABLED, NVML_P2P_CAPS_INDEX_READ, NVML_P2P_STATUS_OK, NVML_NVLINK_MAX_LINKS = 1, 0, 0, 18

    class _Pci:
        def __init__(self, b):
            self.busId = b

    BUS = {0: "00000000:18:00.0", 1: "00000000:2A:00.0", 2: "00000000:9B:00.0"}

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if h in (0, 1) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self._Pci(self.BUS[1 - h])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0 if {a, b} == {0, 1} else 2


def test_topology_from_nvml():
    nv = FakeNVML()
    handles = [(0, 0), (1, 1), (2, 2)]
    gpus = [{"rank": r, "name": "NVIDIA H200", "memory_gib": 140.4, "pci": nv.BUS[r]} for r in range(3)]
    topo = envinfo._topology(nv, handles, gpus)
    assert topo["matrix"] == [["X", "NV18", "SYS"], ["NV18", "X", "SYS"], ["SYS", "SYS", "X"]]
    assert topo["pairs"][0] == {"ranks": [0, 1], "link": "NV18", "nvlinks": 18, "p2p_read": "ok",
                                "meaning": "18 NVLink(s)"}
    env = {"torch": "2.x", "tpprobe": "0.1", "nccl": "2.27.3", "driver": "580.1", "gpus": gpus, "topology": topo,
           "ranks_per_node": 3, "world_size": 3}
    lines = envinfo.env_lines(env)
    assert "NCCL 2.27.3" in lines[0] and "3 ranks/node" in lines[1]
    assert "rank 0,1,2: NVIDIA H200 140.4 GiB" in lines[2] and "driver 580.1" in lines[2]
    assert "NV18 P2P (0-1)" in lines[3] and "SYS (0-2, 1-2)" in lines[3]
    html = render_html({"settings": {"world_size": 3}, "environment": env, "points": [], "findings": [],
                        "allreduce": {}, "slots": []})
    assert parse(html).tables["topo"][1] == [("rank 0", ""), ("X", ""), ("NV18", ""), ("SYS", "")]


class SwitchNVML(FakeNVML):
    """An HGX board: every NVLink of GPUs 0 and 1 ends at an NVSwitch (remote PCI ids are the
    switches'), as on the H200 machine where NVML's common ancestor said PHB."""
    NVML_NVLINK_DEVICE_TYPE_SWITCH, NVML_P2P_CAPS_INDEX_NVLINK = 2, 3

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self._Pci(f"00000000:{0xC0 + link % 4:02X}:00.0")

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 30

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return 0 if {a, b} == {0, 1} else 2


SMI_TOPO = """\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\t0-31\t0
GPU1\tNV18\t X \tSYS\t0-31\t0
GPU2\tSYS\tSYS\t X \t0-31\t0

Legend:
  X    = Self
"""


def test_topology_through_nvswitches_reads_nv18_not_phb(monkeypatch):
    nv = SwitchNVML()
    gpus = [{"rank": r, "name": "NVIDIA H200", "memory_gib": 140.4, "pci": nv.BUS[r], "index": r} for r in range(3)]
    monkeypatch.setattr(envinfo, "_smi_topo", lambda: {})
    topo = envinfo._topology(nv, [(0, 0), (1, 1), (2, 2)], gpus)
    assert topo["matrix"][0] == ["X", "NV18", "PHB"], topo
    assert "NV18 P2P (0-1)" in envinfo.env_lines({"gpus": gpus, "topology": topo})[3]


def test_topology_falls_back_to_nvidia_smi(monkeypatch):
    nv = SwitchNVML()
    monkeypatch.setattr(SwitchNVML, "nvmlDeviceGetNvLinkState", lambda self, h, link: 0)   # NVML says nothing
    gpus = [{"rank": r, "pci": nv.BUS[r], "index": r} for r in range(3)]
    assert envinfo.parse_smi_topo(SMI_TOPO)[(0, 1)] == "NV18"
    monkeypatch.setattr(envinfo, "_smi_topo", lambda: envinfo.parse_smi_topo(SMI_TOPO))
    topo = envinfo._topology(nv, [(0, 0), (1, 1), (2, 2)], gpus)
    assert topo["matrix"] == [["X", "NV18", "PHB"], ["NV18", "X", "PHB"], ["PHB", "PHB", "X"]]


# ---- progress display ---------------------------------------------------------------------------------
def test_progress_display_draws_phases_and_stays_quiet(monkeypatch):
    from rich.console import Console
    from tpprobe.capture.progress import Progress
    from tpprobe.report.live import LiveProgress, stop_all
    monkeypatch.setenv("NO_COLOR", "1")
    buf = io.StringIO()
    prog = Progress()
    lp = LiveProgress(prog, console=Console(file=buf, force_terminal=True, width=100), delay=0.05,
                      refresh_per_second=50).start()
    prog.set("build")
    time.sleep(0.25)
    prog.set("forward", "layer 3")
    time.sleep(0.25)
    stop_all()
    out = buf.getvalue()
    assert "building the model" in out and "forward under the hooks" in out and "layer 3" in out
    assert not re.search(r"\x1b\[[0-9;]*3[0-7]m|\x1b\[38;", out), "NO_COLOR: no colour codes"
    assert lp._thread is not None and not lp._thread.is_alive()
    # quiet: not rank 0 / --quiet / not a terminal -> nothing starts, nothing is written
    for kw in ({"enabled": False, "console": Console(file=io.StringIO(), force_terminal=True)},
               {"enabled": True, "console": Console(file=io.StringIO(), force_terminal=False)}):
        lp = LiveProgress(Progress(), **kw).start()
        assert lp._thread is None and kw["console"].file.getvalue() == ""
        lp.stop()


# ---- chromium: the browser renders the faulty run's report ------------------------------------------
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(f"chromium is missing in CI: install it with `{CHROMIUM_INSTALL}`")
    pytest.skip(f"chromium not installed (install: {CHROMIUM_INSTALL})")


@pytest.fixture
def chromium() -> str:
    return _chromium()


def _browser(chromium: str, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}", "--force-device-scale-factor=1"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=90)


def test_chromium_renders_faulty_report(chromium, faulty, tmp_path):   # chromium first: skip before the run
    page = (faulty["dir"] / "report.html").as_uri()
    shot = tmp_path / "shot.png"
    p = _browser(chromium, ["--window-size=1280,1600", f"--screenshot={shot}", page], tmp_path)
    assert shot.exists(), p.stderr[-2000:]
    data = shot.read_bytes()
    png_chunks(data)
    assert png_size(data) == (1280, 1600)
    assert len(data) > 30_000, f"screenshot of {len(data)} bytes: blank page?"
    dom = _browser(chromium, ["--dump-dom", page], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = parse(dom.stdout).alltext
    for f in faulty["report"]["findings"]:
        assert re.sub(r"\s+", " ", f["line"]) in text
    assert "Capture points × ranks" in text


def test_html_without_matplotlib_says_how_to_get_the_heatmaps(faulty, monkeypatch):
    """matplotlib is an extra (`tpprobe[html]`): without it the page is still whole and says how."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib now raises ImportError
    page = render_html(faulty["report"])
    doc = Doc()
    doc.feed(page)
    text = " ".join(doc.text)
    assert doc.imgs == []
    assert "pip install 'tpprobe[html]'" in text and "tpprobe report DIR --html FILE" in text
    assert faulty["report"]["findings"][0]["line"][:40] in text, "the verdict is still there"


def test_a_cells_number_says_its_unit_and_a_nan_only_difference_shows_the_counts():
    # one column mixes whole-tensor cells (max abs diff) and fingerprint cells (relative L2 diff)
    assert cell_label({"level": "material", "max_abs": 2.6}) == "material 2.6 abs"
    assert cell_label({"level": "material", "max_abs": None, "rel_norm": 0.5}) == "material ~0.5 rel"
    # the finite values agree: the difference is the NaN, not a "0"
    assert cell_label({"level": "material", "max_abs": 0.0, "nan": 1, "inf": 0}) == "material nan=1 inf=0"
    assert cell_label({"level": "bitwise", "max_abs": 0.0, "nan": 1024, "inf": 0}) == "bitwise nan=1024 inf=0"


def test_markdown_marks_go_around_the_words_not_the_indent():
    # CommonMark reads `**  FAILURE x**` as literal asterisks: an indented finding line must stay bold
    from tpprobe.report.markdown import _section_cell
    from tpprobe.report.model import Cell
    assert _section_cell(Cell("  FAILURE x at y", "failure")) == "  **FAILURE x at y**"
    assert _section_cell(Cell(" a.py ", style="code")) == " `a.py` "
    assert _section_cell(Cell("   ", "failure")) == "   "


def test_every_level_and_severity_has_its_words_and_styles_declared_once():
    """core/noise.py declares the levels and their order, checks/findings.py the severities; report/labels.py
    gives each its style in every renderer (one declaration, read everywhere)."""
    from tpprobe.checks.findings import SEVERITIES
    from tpprobe.core.noise import LEVEL_ORDER, LEVEL_RANK
    from tpprobe.invariance.levels import RANK
    from tpprobe.report.labels import LEVELS
    assert set(LEVEL_ORDER) | set(LEVEL_RANK) | set(SEVERITIES) <= set(LEVELS)
    assert RANK is LEVEL_RANK
    assert sorted(LEVEL_RANK, key=LEVEL_RANK.get)[:4] == ["bitwise", "noise", "material", "shape"]
