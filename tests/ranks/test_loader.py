"""The capture loader: verifies before it trusts, never executes, never escapes the folder.

A real 2-rank capture (the CLI, gloo) is made once; every test copies it and breaks the copy.
`tpprobe report` runs through the CLI's own main() in this process (exit code + JSON report).
The property tests (hypothesis) throw random corruptions, truncations and hostile manifests at
`load_run`: it loads correctly or raises TPProbeError, nothing else, within a deadline.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from tpprobe.formats.capture_dir import MANIFEST, CaptureError, check_out_dir, load_run, read_manifest, safe_torch_load
from tpprobe.core.errors import TPProbeError, UsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("loader") / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--out", str(out), "--quiet",
                        "--timeout", "30"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.fixture
def run_dir(healthy, tmp_path) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(healthy, d)
    return d


def report(d: Path, capsys) -> tuple[int, dict | str]:
    from tpprobe.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["report", str(d), "--json"])
    cap = capsys.readouterr()
    return e.value.code, (json.loads(cap.out) if cap.out.strip() else cap.err)


def file_findings(rep: dict) -> dict[str, dict]:
    return {f["where"]: f for f in rep["findings"] if f["kind"] == "capture-file"}


def rewrite_rank(d: Path, rank: int, edit) -> None:
    """Change rank's tensors and re-seal the manifest (a capture that is genuinely so)."""
    name = f"rank-{rank:03d}.safetensors"
    t = load_file(str(d / name))
    edit(t)
    save_file(t, str(d / name), metadata={"schema": "tpprobe.capture/1", "rank": str(rank)})
    m = json.loads((d / MANIFEST).read_text())
    for e in m["files"]:
        if e["path"] == name:
            e["size"] = (d / name).stat().st_size
            e["sha256"] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / MANIFEST).write_text(json.dumps(m))


# ---- the healthy folder ------------------------------------------------------------------------
def test_healthy_capture_loads_and_verifies(healthy, capsys):
    m = read_manifest(healthy)
    assert m["schema"] == "tpprobe.capture/1"
    for e in m["files"]:
        assert e["size"] == (healthy / e["path"]).stat().st_size
        assert e["sha256"] == hashlib.sha256((healthy / e["path"]).read_bytes()).hexdigest()
    assert not [p for p in healthy.iterdir() if p.name.startswith(".")], "a temporary file was left behind"
    run = load_run(healthy)
    assert run.problems == [] and sorted(run.records) == [0, 1]
    rc, rep = report(healthy, capsys)
    assert rc == 0, rep


# ---- broken files: named, every other rank still reported, never healthy ------------------------
@pytest.mark.parametrize("how", ["truncate", "flip", "delete", "garbage-json"])
@pytest.mark.parametrize("which", ["rank-001.safetensors", "rank-001.json"])
def test_broken_file_is_named_and_the_other_rank_reported(run_dir, capsys, how, which):
    p = run_dir / which
    data = p.read_bytes()
    if how == "truncate":
        p.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        p.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif how == "delete":
        p.unlink()
    else:
        p.write_bytes(b"{not json" + b"x" * (len(data) - 9))   # same size, wrong content
    rc, rep = report(run_dir, capsys)
    assert rc == 2, rep      # damaged input: exit 2, the readable rank still in --json
    ff = file_findings(rep)
    assert which in ff and ff[which]["ranks"] == [1] and ff[which]["severity"] == "failure"
    run = load_run(run_dir)
    assert sorted(run.records) == [0]
    cols = {p["name"]: p["per_rank"] for p in rep["points"]}
    assert "0" in cols["embed.out"] and "1" not in cols["embed.out"]


def test_extra_file_is_named(run_dir, capsys):
    (run_dir / "rank-007.safetensors").write_bytes(b"stray")
    rc, rep = report(run_dir, capsys)
    ff = file_findings(rep)
    assert "rank-007.safetensors" in ff and "extra" in ff["rank-007.safetensors"]["detail"]
    assert sorted(load_run(run_dir).records) == [0, 1]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"schema": "other/9"}', "\xff\xfe",
                                  '{"schema": "tpprobe.capture/1", "world_size": 1e9, "files": []}',
                                  "[" * 100000])
def test_unreadable_manifest_is_one_line_exit_2(run_dir, capsys, text):
    (run_dir / MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe" else b"\xff\xfe")
    rc, err = report(run_dir, capsys)
    assert rc == 2 and isinstance(err, str)
    assert len(err.strip().splitlines()) == 1 and "manifest.json" in err and "Traceback" not in err


@pytest.mark.parametrize("path", ["../outside.json", "/etc/passwd", "a/../../x", "sub/../../x",
                                  "..", "rank-000.json\x00.x", "\\\\server\\share", ""])
def test_manifest_paths_stay_inside(run_dir, capsys, path):
    outside = run_dir.parent / "outside.json"
    outside.write_text("{}")
    m = json.loads((run_dir / MANIFEST).read_text())
    m["files"][0]["path"] = path
    (run_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CaptureError, match="refused"):
        load_run(run_dir)
    rc, err = report(run_dir, capsys)
    assert rc == 2 and "refused" in err


def test_symlink_out_of_the_folder_is_refused(run_dir, tmp_path):
    target = tmp_path / "secret.json"
    target.write_text("{}")
    (run_dir / "rank-001.json").unlink()
    (run_dir / "rank-001.json").symlink_to(target)
    with pytest.raises(CaptureError, match="leaves the capture folder"):
        load_run(run_dir)


# ---- NaN / Inf in a capture: findings ----------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_capture_is_a_finding(run_dir, capsys, value):
    def poison(t):
        for k in ("layer.2.out", "layer.3.out", "layer.4.out", "layer.5.out", "aux.packed"):
            if k in t:
                t[k].view(-1)[3] = value
    rewrite_rank(run_dir, 1, poison)
    rc, rep = report(run_dir, capsys)
    assert rc == 1, rep
    nf = [f for f in rep["findings"] if f["kind"] == "non-finite"]
    assert nf and nf[0]["ranks"] == [1], rep["findings"]


# ---- nothing executes on load ------------------------------------------------------------------
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):   # unpickling this runs code: writes the marker file
        return (Path.write_text, (self.marker, "executed"))


def test_pickle_with_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, evil)
    assert not marker.exists()
    with pytest.raises(CaptureError, match="refused to load"):
        safe_torch_load(evil)
    assert not marker.exists()
    raw = tmp_path / "raw.pt"                       # a bare pickle, not even a torch zip
    raw.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CaptureError):
        safe_torch_load(raw)
    assert not marker.exists()
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.arange(3)}, ok)
    assert torch.equal(safe_torch_load(ok)["w"], torch.arange(3))


def test_pickle_disguised_as_a_capture_is_never_run(run_dir, capsys):
    """A rank file replaced by a pickle (manifest re-sealed): refused, the marker never appears."""
    marker = run_dir.parent / "MARKER"
    name = "rank-001.safetensors"
    torch.save({"x": _Payload(marker)}, run_dir / name)
    m = json.loads((run_dir / MANIFEST).read_text())
    for e in m["files"]:
        if e["path"] == name:
            e["size"] = (run_dir / name).stat().st_size
            e["sha256"] = hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
    (run_dir / MANIFEST).write_text(json.dumps(m))
    rc, rep = report(run_dir, capsys)
    assert rc == 2 and name in file_findings(rep)
    assert not marker.exists()


def test_no_loader_calls_torch_load_but_the_safe_helper():
    import re
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "tpprobe").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\btorch\.load\(|\bpickle\.loads?\(", line) and "weights_only=True" not in line]
    assert hits == [], "load .pt only through tpprobe.formats.capture_dir.safe_torch_load"


# ---- the disk ----------------------------------------------------------------------------------
def test_check_out_dir_refuses_short_space_with_the_number(tmp_path, monkeypatch):
    import shutil as sh
    from collections import namedtuple
    du = namedtuple("du", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: du(1 << 30, 1 << 30, 3 << 20))
    with pytest.raises(UsageError) as e:
        check_out_dir(tmp_path / "o", 10 << 20)
    msg = str(e.value)
    assert "3.1 MB free" in msg and "10.5 MB of captures" in msg and "\n" not in msg
    check_out_dir(tmp_path / "o", 0)                       # writability only
    monkeypatch.setattr(sh, "disk_usage", lambda p: du(1 << 40, 0, 1 << 40))
    check_out_dir(tmp_path / "o", 10 << 20)


# ---- properties --------------------------------------------------------------------------------
PROPS = settings(max_examples=60, deadline=2000, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _load_or_own_error(d: Path):
    try:
        return load_run(d)
    except TPProbeError:
        return None


@PROPS
@given(data=st.data())
def test_property_corrupted_or_truncated_files(healthy, tmp_path_factory, data):
    d = tmp_path_factory.mktemp("prop") / "c"
    shutil.copytree(healthy, d)
    names = sorted(p.name for p in d.iterdir())
    name = data.draw(st.sampled_from(names))
    p = d / name
    raw = bytearray(p.read_bytes())
    op = data.draw(st.sampled_from(["truncate", "flip", "splice"]))
    if op == "truncate":
        raw = raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    changed = bytes(raw) != p.read_bytes()
    p.write_bytes(bytes(raw))
    run = _load_or_own_error(d)
    if run is None or not changed or name in ("report.json",):
        return
    if name != MANIFEST:
        # never reported healthy: the file is named, and its rank is not loaded from it
        assert any(pr["file"] == name for pr in run.problems), run.problems
        assert int(name[5:8]) not in run.records


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)
_paths = st.sampled_from(["rank-000.json", "rank-000.safetensors", "rank-001.json", "../x", "/etc/passwd", "",
                          ".", "..", "a/../../b", "report.json", "manifest.json", "rank-000.json\x00", "x" * 5000,
                          "sub/rank-000.json", "rank-999.json"]) | st.text(max_size=30)
_entry = st.fixed_dictionaries({}, optional={"path": _paths | _json, "rank": st.integers(-3, 5) | _json,
                                             "size": st.integers(-5, 10**7) | _json,
                                             "sha256": st.text(max_size=64) | _json})
_manifest = st.fixed_dictionaries({"schema": st.just("tpprobe.capture/1") | _json},
                                  optional={"world_size": st.integers(-2, 2**40) | _json,
                                            "files": st.lists(_entry | _json, max_size=6) | _json,
                                            "settings": _json, "ranks": _json})


@PROPS
@given(manifest=_manifest | _json, keep_real=st.booleans())
def test_property_hostile_manifest(healthy, tmp_path_factory, manifest, keep_real):
    d = tmp_path_factory.mktemp("hostile") / "c"
    shutil.copytree(healthy, d)
    if keep_real and isinstance(manifest, dict):   # real entries + hostile extras / settings
        real = json.loads((d / MANIFEST).read_text())
        if isinstance(manifest.get("files"), list):
            manifest["files"] = real["files"] + manifest["files"]
    (d / MANIFEST).write_text(json.dumps(manifest))
    run = _load_or_own_error(d)
    if run is not None:
        from tpprobe.capture.record import RankRecord
        for r in run.records.values():   # whatever loaded verified against the manifest, read back typed
            assert isinstance(r.meta, RankRecord)


@PROPS
@given(meta=_json | st.fixed_dictionaries({}, optional={"points": _json, "allreduces": _json, "status": _json,
                                                         "aux": _json, "params": _json,
                                                         "coverage": _json}))
@example(meta={"params": {"": None}})     # CI found it: a parameter entry that is not an object crashed the report
@example(meta={"coverage": {"unreadable_points": [1]}})
def test_property_hostile_rank_metadata_sealed_in_the_manifest(healthy, tmp_path_factory, meta):
    """Even a metadata file the manifest vouches for is checked before the checks read it."""
    d = tmp_path_factory.mktemp("meta") / "c"
    shutil.copytree(healthy, d)
    body = json.dumps(meta).encode()
    (d / "rank-001.json").write_bytes(body)
    m = json.loads((d / MANIFEST).read_text())
    for e in m["files"]:
        if e["path"] == "rank-001.json":
            e["size"], e["sha256"] = len(body), hashlib.sha256(body).hexdigest()
    (d / MANIFEST).write_text(json.dumps(m))
    run = _load_or_own_error(d)
    assert run is not None and 0 in run.records
    if 1 in run.records:   # accepted: the offline report must not crash on it either
        from tpprobe.cli.report import report_dir
        assert report_dir(d, json_out=True, quiet=True) in (0, 1)


def test_torch_load_is_called_in_one_place():
    """Every `.pt` file (capture, dumper record, SpecForge sample, draft checkpoint) is read through
    tpprobe/formats/safe_load.py: the package calls torch.load nowhere else (read from the syntax tree)."""
    import ast
    hits = sorted({str(p.relative_to(ROOT)) for p in (ROOT / "tpprobe").rglob("*.py")
                   for node in ast.walk(ast.parse(p.read_text()))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                   and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"})
    assert hits == ["tpprobe/formats/safe_load.py"], hits
