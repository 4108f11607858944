"""Test helpers that run real processes: the CLI as a subprocess, and N gloo ranks in-process.

How the multi-rank helper works (like PyTorch's MultiProcessTestCase): `spawn(fn, world)` starts
`world` processes, each joins a gloo group through a `file://` rendezvous in a temp dir (no ports),
runs `fn(rank, world, *args)` and sends back its return value or its formatted traceback. The parent
waits up to `timeout` seconds; when one rank fails or time runs out, every straggler gets SIGTERM and,
STOP_GRACE_S later, SIGKILL, so no rank outlives its test, and the test raises with the child's traceback.

The ranks are never forked from pytest itself: pytest has run torch ops (its intra-op pools do not
survive a fork, and a model factory that runs torch ops on threads of its own, as transformers' weight
loader does, trips over the copy) and may have threads of its own. They are forked from
multiprocessing's fork server, a process that imported torch and nothing else ran: each rank starts
with fresh pools, and still skips the interpreter start and the torch import.
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


STOP_GRACE_S = 5       # SIGTERM, then SIGKILL this long after


def _die_with_parent() -> None:
    """A rank never outlives the process that forked it (the fork server, which ends with pytest)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(fn, rank, world, init_file, q, args):
    try:
        _die_with_parent()
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


def context() -> mp.context.BaseContext:
    """The fork server (module docstring), torch preloaded in it; spawn where there is no fork."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def stop(procs, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every rank still alive, SIGKILL `grace` seconds later, then reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def spawn(fn, world: int, *args, timeout: float = 120) -> dict:
    """Run fn(rank, world, *args) on `world` gloo ranks; return {rank: result}."""
    ctx = context()
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
            if not errors:          # every result is in: the ranks are leaving by themselves
                for p in procs:
                    p.join(timeout=5)
            stop(procs)
        if errors:
            rank, tb = next(iter(errors.items()))
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        return results
