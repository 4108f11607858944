"""Test helpers that run real processes: the CLI as a subprocess, and N gloo ranks in-process.

How the multi-rank helper works (like PyTorch's MultiProcessTestCase): `spawn(fn, world)` starts
`world` processes (forked where that is safe, else with the spawn start method), each joins a
gloo group through a `file://` rendezvous in a temp dir (no ports), runs `fn(rank, world, *args)`
and sends back its return value or its formatted traceback. The parent waits up to `timeout` seconds, terminates every
straggler when one fails or time runs out, and raises with the child's traceback.
"""
from __future__ import annotations

import io
import json
import queue
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], timeout: float = 120, cwd=None, env=None, launcher=None) -> subprocess.CompletedProcess:
    """Run `python -m tpprobe ARGS` (after `launcher`, e.g. torchrun's module and options) in its own
    process group; kill the whole group on timeout."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    e.update(env or {})
    cmd = [sys.executable, *(launcher or []), "-m", "tpprobe", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=cwd, env=e, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"tpprobe {' '.join(args)} did not finish in "
                             f"{timeout}s\nstdout:{out[-3000:]}\nstderr:{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_torchrun(nproc: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m tpprobe ARGS` (torch.distributed.run)."""
    return run_cli(args, timeout, launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                            str(nproc)])


def probe(out: Path, *args: str, nproc: int = 2, timeout: float = 120, backend: str = "",
          torchrun: bool = False) -> tuple[int, dict, subprocess.CompletedProcess]:
    """`tpprobe probe --nproc N --out OUT --quiet ARGS` (or under `torchrun --nproc-per-node N`);
    returns (exit code, report.json, process)."""
    args = (*args, "--backend", backend) if backend else args
    if torchrun:
        cp = run_torchrun(nproc, ["probe", "--out", str(out), "--quiet", *args], timeout=timeout)
    else:
        cp = run_cli(["probe", "--nproc", str(nproc), "--out", str(out), "--quiet", *args], timeout=timeout)
    rep_path = Path(out) / "report.json"
    report = json.loads(rep_path.read_text()) if rep_path.exists() else {}
    return cp.returncode, report, cp


def failures(report: dict) -> list[dict]:
    return [f for f in report.get("findings", []) if f["severity"] == "failure"]


def _child(fn, rank, world, init_file, q, args):
    try:
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            buf = io.BytesIO()          # tensors travel as bytes: the child may exit before the parent reads
            torch.save(fn(rank, world, *args), buf)
            q.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def start_method() -> str:
    """fork when it is safe here (no other thread; GNU OpenMP's pool released, as tpprobe's own
    launcher does): each rank then skips the interpreter start and the torch import; else spawn."""
    import threading
    from tpprobe.probe.launch import release_openmp
    return "fork" if hasattr(os, "fork") and threading.active_count() == 1 and release_openmp() else "spawn"


def spawn(fn, world: int, *args, timeout: float = 120) -> dict:
    """Run fn(rank, world, *args) on `world` gloo ranks; return {rank: result}."""
    ctx = mp.get_context(start_method())
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rdzv")
        procs = [ctx.Process(target=_child, args=(fn, r, world, init_file, q, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, {}
        try:
            deadline, gone_at = time.monotonic() + timeout, None
            while len(results) < world and not errors:
                try:
                    rank, status, value = q.get(timeout=0.5)
                except queue.Empty:
                    gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                    gone_at = gone_at or (time.monotonic() if gone else None)
                    if gone and time.monotonic() - gone_at > 5:       # its last put had 5 s to arrive
                        errors[gone[0]] = (f"rank {gone[0]} ended (exit code {procs[gone[0]].exitcode}) without "
                                           f"a result (got results from {sorted(results)})")
                    elif time.monotonic() > deadline:
                        errors[-1] = f"ranks timed out after {timeout}s (got results from {sorted(results)})"
                    continue
                if status == "error":
                    errors[rank] = value
                    break
                results[rank] = torch.load(io.BytesIO(value), weights_only=True)
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.terminate()
        if errors:
            rank, tb = next(iter(errors.items()))
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        return results
