"""Bad usage: one line on stderr (what is wrong, what to do), exit 2, no traceback (--debug shows it).

Every case runs the CLI's main() in a process of its own with its own stderr and exit status. The
ones marked SUBPROCESS are a fresh `python -m tpprobe` (as a user runs it); the rest are forked from
this warm interpreter (same main(), same argv handling; a torch import each would not fit a 2-core
CI budget). Cases whose message comes from a rank (a --model factory is only called on the ranks)
go through the launcher and the ranks' own error line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest



ROOT = Path(__file__).resolve().parents[2]
M = "tests.zoo.disagree"


CASES = {
    "unknown-option": (["probe", "--bogus"], "No such option: --bogus"),
    "unknown-command": (["frobnicate"], "No such command"),
    "layers-not-ints": (["probe", "--layers", "a,b"], "comma-separated integers"),
    "layers-duplicate": (["probe", "--layers", "1,1"], "duplicate"),
    "layers-too-high": (["probe", "--layers", "-1,99"], "out of range"),
    "layers-too-low": (["probe", "--layers=-2"], "out of range"),
    "layers-empty": (["probe", "--layers", ","], "empty"),
    "nproc-zero": (["probe", "--nproc", "0"], "--nproc must be >= 1"),
    "nproc-over-vocab": (["probe", "--nproc", "4", "--vocab", "3"], "--vocab (3) is smaller than the 4 ranks"),
    "nproc-over-heads": (["probe", "--nproc", "3"], "not divisible by 3 ranks"),
    "timeout-zero": (["probe", "--timeout", "0"], "--timeout must be > 0"),
    "embed-std-zero": (["probe", "--embed-std", "0"], "--embed-std must be a positive number (got 0.0)"),
    "backend": (["probe", "--backend", "mpi"], "unknown --backend 'mpi'"),
    # decided once by the launcher, for every rank (this CI box has no GPU)
    "nccl-without-gpus": (["probe", "--backend", "nccl", "--nproc", "2"], "--backend nccl needs a CUDA device"),
    "dtype": (["probe", "--dtype", "int3"], "unknown --dtype"),
    "exchange": (["probe", "--exchange", "half"], "unknown --exchange"),
    "fault": (["probe", "--inject", "explode"], "unknown fault 'explode'"),
    "fault-rank": (["probe", "--inject", "kill-rank@5"], "rank 5 out of range"),
    "fault-arg": (["probe", "--inject", "kill-rank"], "needs @R"),
    "out-unwritable": (["probe", "--out", "{file}/sub"], "cannot write to --out"),
    "report-missing": (["report", "{tmp}/nothing-here"], "no such file or folder"),
    "report-emit-dims": (["report", "{tmp}", "--emit-dims"], "--emit-dims reads SGLang dumper folders"),
    "model-no-colon": (["probe", "--model", "nocolon"], "must be package.module:factory"),
    "arch": (["probe", "--arch", "gpt-j"], "arch"),
    "model-missing": (["probe", "--nproc", "1", "--timeout", "20", "--model", "tests.no_such_module:f"],
                      "cannot import"),
    "model-raises": (["probe", "--nproc", "1", "--timeout", "20", "--model", f"{M}:raises"],
                     "the factory raised RuntimeError"),
    "model-wrong-type": (["probe", "--nproc", "1", "--timeout", "20", "--model", f"{M}:wrong_type"],
                         "returned dict"),
}
ON_RANKS = {"model-missing", "model-raises", "model-wrong-type"}
SUBPROCESS = {"unknown-option", "layers-duplicate", "debug"} | ON_RANKS


def _fork_cli(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """main(args) in a forked child: its own stdout/stderr files and exit status."""
    err, out = tmp / f"err-{os.getpid()}-{id(args)}", tmp / f"out-{os.getpid()}-{id(args)}"
    pid = os.fork()
    if pid == 0:   # child
        code = 70
        try:
            fe, fo = os.open(err, os.O_WRONLY | os.O_CREAT), os.open(out, os.O_WRONLY | os.O_CREAT)
            os.dup2(fe, 2), os.dup2(fo, 1)
            sys.stderr = open(2, "w", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            from tpprobe.cli import main
            try:
                main(list(args))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            try:
                sys.stderr.flush(), sys.stdout.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), out.read_text(), err.read_text())


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "tpprobe", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=180)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usage")
    (tmp / "afile").write_text("")
    fill = {"file": str(tmp / "afile"), "tmp": str(tmp)}
    jobs = {k: [a.format(**fill) for a in args] for k, (args, _) in CASES.items()}
    jobs["debug"] = ["probe", "--layers", "1,1", "--debug"]
    jobs["out-default"] = ["probe", "--layers", "1,1", "--out", str(tmp / "never")]
    res = {k: _fork_cli(a, tmp) for k, a in jobs.items() if k not in SUBPROCESS}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futs = {k: pool.submit(_run, a) for k, a in jobs.items() if k in SUBPROCESS}
        res.update({k: f.result() for k, f in futs.items()})
    return res


def _case(name):
    return pytest.param(name)


@pytest.mark.parametrize("name", [_case(n) for n in CASES])
def test_bad_usage_is_one_line_exit_2(results, name):
    p = results[name]
    want = CASES[name][1]
    assert p.returncode == 2, (p.returncode, p.stderr[-1500:])
    lines = p.stderr.strip("\n").splitlines()
    assert "Traceback" not in p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("tpprobe: error: ") and want in lines[0], lines[0]


def test_debug_shows_the_traceback(results):
    p = results["debug"]
    assert p.returncode == 2
    assert "Traceback" in p.stderr and "UsageError" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("tpprobe: error: ")


def test_refused_run_writes_nothing(results, tmp_path_factory):
    p = results["out-default"]
    assert p.returncode == 2 and "duplicate" in p.stderr


def test_short_disk_is_refused_up_front_with_the_number(tmp_path):
    """A 1 MB tmpfs as --out: the ranks estimate what they will write and refuse before writing."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); test_loader covers check_out_dir in-process")
    try:
        p = _run(["probe", "--nproc", "1", "--out", str(mnt / "cap"), "--quiet", "--timeout", "20"])
        assert p.returncode == 2, p.stderr[-1500:]
        assert "Traceback" not in p.stderr
        assert "MB free but this probe needs" in " ".join(p.stderr.split())
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        left = [q.name for q in (mnt / "cap").iterdir()] if (mnt / "cap").exists() else []
        assert not any(n.startswith("rank-") for n in left), left
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_one_backend_for_every_rank(monkeypatch):
    """The rule depends on the node (its GPUs against its ranks), never on the rank: 4 ranks on a
    2-GPU node all run gloo, or an explicit nccl is one line and exit 2."""
    import torch
    from tpprobe.core.errors import UsageError
    from tpprobe.exchange.dist import choose_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_backend(None, 2) == choose_backend("auto", 2) == "nccl"
    assert choose_backend(None, 4) == "gloo"
    assert choose_backend("gloo", 2) == "gloo"
    with pytest.raises(UsageError, match=r"4 ranks on this node, 2 GPU\(s\); run --nproc 2 or --backend gloo"):
        choose_backend("nccl", 4)
