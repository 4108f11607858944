"""`tpprobe probe` without torchrun: start N local ranks; `tpprobe torchrun`: torchrun itself (every
option of it), ending like a tpprobe command.

Every rank runs `tpprobe probe ...` with the environment torchrun would give it (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, the store hosted by the launcher), on a free
local port. Two ways to start them, one contract:

- **fork** (CPU gloo ranks, the default there): the launcher has torch imported already, so each
  rank is forked from it and skips the interpreter start and the torch import (about 2.5 s of CPU a
  rank). The launcher hosts the rendezvous store, as the elastic agent does, so a rank that dies
  never takes the store with it. GNU OpenMP's thread pool does not survive a fork (a rank's first
  parallel op would hang): the launcher releases it first (`omp_pause_resource_all`), and spawns
  when it cannot, or when a thread of its own runs beside it.
  torch's own intra-op pool (pthreadpool) is marked leaked by a fork and rebuilt by the next
  `set_num_threads`: a rank rebuilds it first, on its only thread, so a model factory whose threads
  all start parallel ops at once (transformers' weight loader) never races over the rebuild.
- **spawn** through PyTorch's elastic agent (NCCL ranks, which need a fresh CUDA; or
  TPPROBE_RANK_START=spawn).

Either way: when one rank fails the others get SIGTERM (a probe rank ignores it and goes on to
report the failure) and SIGKILL 30 s later, as the elastic agent does. And either way, unless
OMP_NUM_THREADS is set, each of N ranks runs torch on its share of the cores (cores // N, at least 1),
as torchrun gives each of its ranks one thread: N ranks of a full pool each would spin on the same cores.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

STOP_GRACE_S = 30      # the elastic agent's: SIGTERM, then SIGKILL this long after (TPPROBE_STOP_GRACE_S)


def _quiet_agent() -> None:
    """The agent logs a failed worker as an error; a finding (exit 1) is not one: the report says it."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def agreed_code(codes: list[int]) -> int:
    """The ranks' exit codes as one: 0 when all are 0; else bad usage (2) over an internal error (3)
    over findings (1); a rank killed by a signal (a negative code) counts as 1."""
    from ..core.errors import INTERNAL_EXIT
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    return 2 if 2 in failed else INTERNAL_EXIT if INTERNAL_EXIT in failed else 1


def _agreed_code(e) -> int:
    return agreed_code([f.exitcode for f in e.failures.values()]) or 1


def start_method() -> str:
    """fork or spawn, for the ranks this launcher is about to start (module docstring)."""
    from ..exchange.dist import BACKEND_ENV, GLOO_CUDA_ENV
    from ..config.knobs import knob, knob_set
    from ..core.errors import UsageError
    asked = (knob("TPPROBE_RANK_START") or "auto").strip().lower()
    if asked not in ("auto", "fork", "spawn"):
        raise UsageError(f"TPPROBE_RANK_START={asked!r}: say auto, fork or spawn")
    cpu_gloo = os.environ.get(BACKEND_ENV) == "gloo" and not knob_set(GLOO_CUDA_ENV)
    if asked == "spawn" or not hasattr(os, "fork"):
        return "spawn"
    if asked == "fork" and not cpu_gloo:
        raise UsageError("TPPROBE_RANK_START=fork: only CPU gloo ranks can be forked (CUDA does not survive a "
                         "fork); unset it, or say spawn")
    if not cpu_gloo or _entry() is None:
        return "spawn"
    # a thread of the launcher's (none today) would not be copied into the ranks: never fork beside one
    return "fork" if threading.active_count() == 1 and release_openmp() else "spawn"


def _entry():
    """The CLI's main(), which a forked rank runs: the launcher always runs inside a tpprobe command,
    so it is imported already (looked up, not imported: the CLI sits above this module)."""
    return getattr(sys.modules.get("tpprobe.cli"), "main", None)


def release_openmp() -> bool:
    """Release GNU OpenMP's thread pool (torch's CPU build ships libgomp) so a forked rank starts its
    own; False when it is loaded and says no. Another OpenMP runtime (LLVM's, Intel's) re-creates its
    pool after a fork by itself."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:      # the loaded copy, whatever a wheel renamed it to
            libs = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return False        # not Linux: cannot tell, so never fork
    for path in libs:
        try:
            gomp = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            return False
        pause = getattr(gomp, "omp_pause_resource_all", None)
        if pause is None or pause(2) != 0:      # 2: omp_pause_hard, the pool's threads end
            return False
    return True


def rank_threads(nproc: int) -> int | None:
    """torch's threads for each of nproc local ranks: the cores this process may run on, shared out
    (at least 1); None when OMP_NUM_THREADS is set (the user's choice stands) or there is one rank."""
    if nproc <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


def launch_local(nproc: int, argv: list[str], warm=None) -> int:
    """Run `tpprobe <argv>` on nproc local ranks; return the ranks' agreed exit code. `warm()`, when
    the ranks are forked: imports every rank would make (once, in the launcher, before the fork)."""
    method = start_method()
    if method == "fork" and warm is not None:
        warm()
        method = start_method()         # asked again: warm() must have started no thread
    threads = rank_threads(nproc)
    if method == "fork":
        return _launch_forked(nproc, argv, threads)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    _quiet_agent()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    if threads is not None:           # a spawned rank's torch reads it when it starts
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tpprobe", *argv)
    except ChildFailedError as e:
        return _agreed_code(e)
    finally:
        if threads is not None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return 0


def _rank_env(nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What the elastic agent sets for its workers (one node, no restarts), less the rank."""
    return {"GROUP_RANK": "0", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _rank_child(rank: int, env: dict[str, str], argv: list[str], listener: socket.socket, launcher: int,
                threads: int | None = None) -> None:
    """A forked rank: torchrun's environment, then `tpprobe <argv>`; never returns."""
    code = 1
    try:
        listener.close()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        _die_with_launcher(launcher)
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        fresh_pools(threads)
        _entry()(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:           # main() catches everything of ours; this is the interpreter's
        import traceback
        traceback.print_exc()
        from ..core.errors import INTERNAL_EXIT
        code = INTERNAL_EXIT
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


def fresh_pools(threads: int | None = None) -> None:
    """A forked rank's intra-op pool, rebuilt now on its only thread, of `threads` threads (rank_threads), or
    as many as before (module docstring)."""
    import torch
    torch.set_num_threads(threads or torch.get_num_threads())


def _die_with_launcher(launcher: int) -> None:
    """A rank never outlives its launcher, however the launcher ends (SIGKILL included)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != launcher:       # it ended before the line above
        os._exit(1)


class _Stopped(Exception):
    pass


def _stop(signum, frame):
    raise _Stopped(signum)


def _launch_forked(nproc: int, argv: list[str], threads: int | None = None) -> int:
    import torch.distributed as dist
    from datetime import timedelta
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    env = _rank_env(nproc, listener.getsockname()[1], str(uuid.uuid4()))
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    launcher = os.getpid()
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for r in range(nproc):
            pid = os.fork()
            if pid == 0:
                _rank_child(r, env, argv, listener, launcher, threads)
            ranks[pid] = r
        # the store after the forks (its server thread is not copied into a rank); the ranks' clients
        # retry until it listens. The listening socket was bound first: no other process takes the port.
        store = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), world_size=None, is_master=True,
                              timeout=timedelta(hours=1), wait_for_workers=False,
                              master_listen_fd=listener.fileno(), use_libuv=False)
        listener.detach()       # the store owns the socket now, and closes it
        codes = _wait_ranks(ranks)
        del store
        return agreed_code(codes)
    except _Stopped as e:      # the launcher was told to stop: so are its ranks, and it ends as told
        _kill(ranks, signal.SIGKILL)
        return 128 + e.args[0]
    except BaseException:
        _kill(ranks, signal.SIGKILL)
        raise
    finally:
        listener.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _wait_ranks(ranks: dict[int, int]) -> list[int]:
    """Every rank's exit code (a signal: its negative number). After the first failure the others
    get SIGTERM, and SIGKILL the grace later (TPPROBE_STOP_GRACE_S, default STOP_GRACE_S)."""
    from ..config.knobs import knob, knob_float
    grace = knob_float("TPPROBE_STOP_GRACE_S") if knob("TPPROBE_STOP_GRACE_S") else STOP_GRACE_S
    codes: dict[int, int] = {}
    kill_at = None
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.time() > kill_at:
                _kill({p: r for p, r in ranks.items() if p not in codes}, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and kill_at is None:
            _kill({p: r for p, r in ranks.items() if p not in codes}, signal.SIGTERM)
            kill_at = time.time() + grace
    return [codes[p] for p in sorted(ranks, key=ranks.get)]


def _kill(ranks: dict[int, int], sig: int) -> None:
    for pid in ranks:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


COMMANDS = ("probe",)   # what `tpprobe torchrun` may start on the ranks


def _check_command_args(args: list[str]) -> None:
    """The command's options that mean nothing under torchrun, refused before anything starts."""
    from ..core.errors import UsageError
    given = [a.split("=", 1)[0] for a in args[1:]]
    if "--nproc" in given:
        raise UsageError(f"tpprobe torchrun: {args[0]} --nproc starts ranks itself; under torchrun the ranks are "
                         f"torchrun's: put --nproc-per-node N before {args[0]} (tpprobe torchrun --nproc-per-node 4 "
                         f"{args[0]} ...)")


def _check_nproc_per_node(value) -> None:
    """torchrun's --nproc-per-node: a count >= 1, or auto / cpu / gpu (torch.distributed.run's own words)."""
    from ..core.errors import UsageError
    text = str(value).strip()
    if text in ("auto", "cpu", "gpu", "xpu"):
        return
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise UsageError(f"tpprobe torchrun: --nproc-per-node {text!r}: give the ranks per node, a number >= 1 "
                         f"(or auto, cpu, gpu), e.g. tpprobe torchrun --nproc-per-node 4 probe")


def torchrun(argv: list[str]) -> int:
    """`torchrun [its options] -m tpprobe COMMAND [options]`, with torchrun's own parser and launch,
    ending like a tpprobe command: 0 healthy, 1 findings, 2 bad usage, and no ChildFailedError
    traceback (plain torchrun prints one whenever a rank exits non-zero, a finding included)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from ..core.errors import UsageError
    cut = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if cut is None:
        raise UsageError("tpprobe torchrun: name the command after torchrun's options, e.g. "
                         "tpprobe torchrun --nproc-per-node 4 probe --layers -1,1,3")
    _check_command_args(argv[cut:])
    from torch.distributed.run import parse_args, run
    import contextlib
    import io
    said = io.StringIO()
    try:
        # torchrun's parser reads torchrun's options only: the command's own (`probe --nproc 2`) would
        # otherwise be matched against torchrun's as abbreviations (`--nproc` -> --nproc-per-node?)
        with contextlib.redirect_stderr(said):
            args = parse_args([*argv[:cut], "-m", "tpprobe"])
    except SystemExit as e:      # argparse's usage block: keep its last line, the reason
        why = (said.getvalue().strip().splitlines() or ["bad options"])[-1].split("error: ", 1)[-1]
        raise UsageError(f"tpprobe torchrun: torchrun's options: {why} "
                         f"(python -m torch.distributed.run --help lists them)") from e
    args.training_script_args = list(argv[cut:])
    _check_nproc_per_node(args.nproc_per_node)
    _quiet_agent()
    try:
        run(args)
    except ChildFailedError as e:
        return _agreed_code(e)
    return 0
