"""Spawn N real gloo ranks (separate python processes) running one function; collect results.

    results = run_ranks(f"{__name__}:worker", world=2, kwargs={...}, timeout=120)   # a test module's own worker

Each child (forked from the test process where that is safe, else a fresh python): initializes
torch.distributed (gloo, file:// rendezvous in a fresh temp dir), builds a tpprobe RankContext,
calls `fn(ctx, **kwargs)` (fn given as "module:function", the module by its dotted path from the
checkout), pickles the return value, destroys the process group. The parent waits up to
`timeout` seconds in total, kills every straggler, and raises RanksFailed with each failed
child's exit code and stderr tail (its traceback).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time

# "module:function" is looked up with the checkout on the path, by its dotted path (tests.engines.sglang.test_x);
# tests/ itself is not put on it (its tier folders would become top-level packages: engines, gpu, ...)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RanksFailed(AssertionError):
    pass


LAST_LOGS: list = []   # each rank's stdout+stderr of the last run_ranks call


def run_ranks(fn: str, world: int, kwargs: dict | None = None, timeout: float = 180.0,
              env: dict | None = None) -> list:
    with tempfile.TemporaryDirectory(prefix="tpprobe-ranks-") as tmp:
        args_path = os.path.join(tmp, "args.pkl")
        with open(args_path, "wb") as f:
            pickle.dump(kwargs or {}, f)
        init = "file://" + os.path.join(tmp, "rendezvous")
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["PYTHONPATH"] = os.pathsep.join([ROOT, child_env.get("PYTHONPATH", "")])
        child_env.setdefault("OMP_NUM_THREADS", "1")
        procs, logs = [], []
        fork = _fork_ok()
        if fork:
            _preload_sglang()
        for r in range(world):
            log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            logs.append(log)
            argv = [fn, str(r), str(world), init, args_path, os.path.join(tmp, f"rank{r}.pkl")]
            if fork:
                procs.append(_Forked(argv, log, env or {}))
                continue
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *argv],
                stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT))
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for p in procs:
                left = deadline - time.monotonic()
                try:
                    p.wait(timeout=max(left, 0.1))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for p in procs:  # kill stragglers (only our own children, by handle)
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = []
        LAST_LOGS.clear()
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            out = log.read()
            log.close()
            LAST_LOGS.append(out)
            if p.returncode != 0:
                failed.append(f"--- rank {r} exit {p.returncode} ---\n{out[-6000:]}")
        if timed_out or failed:
            head = f"{fn} at world={world}: " + (f"timed out after {timeout:.0f}s; " if timed_out else "")
            raise RanksFailed(head + f"{len(failed)} rank(s) failed\n" + "\n".join(failed))
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _fork_ok() -> bool:
    """Fork the ranks from this process where that is safe (no other thread; GNU OpenMP's pool
    released, as tpprobe's own launcher does): each skips the interpreter start and the torch and
    SGLang imports. TPPROBE_RANK_START=spawn says no here too."""
    import threading
    from tpprobe.config.knobs import knob
    from tpprobe.probe.launch import release_openmp
    return (knob("TPPROBE_RANK_START") != "spawn" and hasattr(os, "fork") and threading.active_count() == 1
            and release_openmp())


def _preload_sglang() -> None:
    """SGLang's model stack, imported once here, before the forks (imports only)."""
    from tpprobe.engines.sglang.tiny import preload
    preload(None)


class _Forked:
    """One rank forked from this process, with Popen's poll / wait / kill / returncode."""

    def __init__(self, argv: list[str], log, env: dict):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ.update(env)
                sys.path[:0] = [ROOT]
                _child(argv[0], int(argv[1]), int(argv[2]), *argv[3:])
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("rank", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, 9)


def _child(fn: str, rank: int, world: int, init: str, args_path: str, out_path: str) -> None:
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from tpprobe.core.target import RankContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        ctx = RankContext(rank=rank, world_size=world, local_rank=rank,
                          device=torch.device("cpu"), backend="gloo", group=None, seed=0)
        mod, name = fn.split(":")
        with open(args_path, "rb") as f:
            kwargs = pickle.load(f)
        result = getattr(importlib.import_module(mod), name)(ctx, **kwargs)
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    _child(a[0], int(a[1]), int(a[2]), a[3], a[4], a[5])
