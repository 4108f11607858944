"""Process-group setup, the probe's own key-value channel, and the watchdog.

How the probe never hangs on a broken peer
------------------------------------------
The model's collectives run on the model's group, bounded by the process group's timeout. The
probe's own exchange does NOT start with a collective: every rank first posts its metadata (what
it captured, every all-reduce it issued, its status) to the rendezvous store, and waits for the
others' with a deadline, polling. A rank that died, hung or issued a different sequence of
collectives therefore shows up as a missing or disagreeing post, never as a hang. Only when every
rank posted and the posts agree do ranks run collectives again (the tensor exchange), on a
dedicated gloo group whose sequence all ranks derive from the same metadata.

A watchdog thread per rank posts a heartbeat (phase, place, the all-reduce it is blocked in) so the
others can say what a missing rank was doing; if its own main thread sits in one all-reduce
longer than `stall` seconds it posts that too (the others conclude "rank R issued a collective we
never will"); and when rank 0 posts the final verdict it ends a rank whose main thread is stuck.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..core.errors import INTERNAL_EXIT, UsageError, internal_line
from ..config.knobs import knob, knob_set
from ..capture.progress import Progress
from ..core.target import RankContext


def env_rank() -> Optional[tuple[int, int, int]]:
    """(rank, world_size, local_rank) when launched by torchrun / the elastic agent, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    except ValueError:
        raise UsageError("RANK / WORLD_SIZE / LOCAL_RANK must be integers (set by torchrun)")


BACKEND_ENV = "TPPROBE_DIST_BACKEND"     # the launcher's one decision, passed to every rank


def named_process_group(backend: str) -> Optional[str]:
    """`tpprobe probe --backend` as `init` and `choose_backend` take it: gloo or nccl when named; None when
    the launcher decides (auto)."""
    return None if backend == "auto" else backend


def choose_backend(requested: Optional[str], local_world: int) -> str:
    """One rule for every rank of a node (it depends on the node, never on the rank): NCCL when
    each of the node's ranks has its own GPU, else gloo; an explicit nccl that cannot hold is a
    usage error."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested and requested != "auto":
        if requested not in ("gloo", "nccl"):
            raise UsageError(f"unknown --backend {requested!r}: use gloo, nccl or auto")
        if requested == "nccl" and gpus < local_world:
            raise UsageError(f"--backend nccl needs one GPU per rank: {local_world} ranks on this node, "
                             f"{gpus} GPU(s); run --nproc {gpus} or --backend gloo" if gpus else
                             "--backend nccl needs a CUDA device on every rank; use --backend gloo on CPU")
        return requested
    return "nccl" if gpus and gpus >= local_world else "gloo"


def _agree_backend(choice: str, rank: int, world: int, timeout: float) -> str:
    """Under torchrun (no launcher of ours): every rank posts its node's choice to the agent's
    store and all take the same one (gloo if any node cannot run NCCL)."""
    try:
        ch = Channel(open_store(timeout, run_prefix()), rank, world)
        ch.post("backend", {"backend": choice})
        got = ch.collect("backend", time.time() + timeout)
    except Exception:
        return choice
    if len(got) < world:
        raise UsageError(f"ranks {sorted(set(range(world)) - set(got))} did not start within --timeout "
                         f"{timeout:g}s (no backend agreed)")
    return "gloo" if any(v["backend"] == "gloo" for v in got.values()) else "nccl"


# The NCCL process group's own timeout is deliberately LONGER than the probe's device deadline
# (--timeout): the probe notices a stuck collective first (CUDA events), reads the flight recorder,
# aborts the communicator and writes the report; the watchdog is only the backstop, and with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up only) it aborts the communicator without killing the
# process that is writing the report (the default, 3, took the surviving rank down first).
NCCL_PG_SLACK_S = 30.0
GLOO_CUDA_ENV = "TPPROBE_GLOO_CUDA"
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            # the flight recorder's ring (TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.7)
            ("TORCH_FR_BUFFER_SIZE" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 7)
             else "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000"}


def init(backend: Optional[str], timeout: float, seed: int = 0) -> RankContext:
    rank, world, local = env_rank() or (0, 1, 0)
    decided = knob(BACKEND_ENV)
    if decided in ("gloo", "nccl"):
        backend = decided
    else:
        backend = choose_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            backend = _agree_backend(backend, rank, world, timeout)
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "gloo" and knob_set(GLOO_CUDA_ENV) and torch.cuda.is_available():
        # diagnostic: gloo ranks with their tensors on CUDA (several ranks may share one GPU), so
        # the CUDA paths (fingerprint kernels, device-lag events, the audit on CUDA tensors) run at
        # tp > 1 on a machine with fewer GPUs than ranks. Not NCCL: proves nothing about NCCL.
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if backend == "nccl":
        torch.cuda.set_device(device)
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
    if not dist.is_initialized():
        pg_timeout = timeout + NCCL_PG_SLACK_S if backend == "nccl" else timeout
        dist.init_process_group(backend, timeout=timedelta(seconds=pg_timeout),
                                **({"device_id": device} if backend == "nccl" else {}))
    return RankContext(rank=rank, world_size=world, local_rank=local, device=device,
                       backend=backend, group=None, seed=seed)


def wait_device(deadline: float, poll: float = 0.005) -> bool:
    """Has the current CUDA stream drained by ``deadline`` (time.time())?  Polls an event: the
    host never blocks on a stream that a dead peer's collective holds."""
    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        if time.time() >= deadline:
            return False
        time.sleep(poll)
    return True


def abort_nccl(timeout: float = 5.0) -> str:
    """Abort the default group's NCCL communicator so no kernel stays blocked on a dead peer; in a
    thread of its own, waited for at most ``timeout`` s (an abort that blocks never holds the report)."""
    res = {"r": "abort did not return within %gs" % timeout}

    def go():
        try:
            fn = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if fn is not None:
                fn()
            else:
                dist.distributed_c10d._get_default_group().abort()
            res["r"] = "aborted"
        except Exception as e:     # already torn down by the watchdog, or an older torch
            res["r"] = f"abort failed: {type(e).__name__}: {e}"
    t = threading.Thread(target=go, daemon=True, name="tpprobe-nccl-abort")
    t.start()
    t.join(timeout)
    return res["r"]


def flight_recorder() -> Optional[dict]:
    """PyTorch's NCCL Flight Recorder, summarised: for each process group, the last collective
    sequence number this rank's NCCL scheduled, started and completed, and the first one not
    completed.  None when unavailable (gloo, no buffer)."""
    try:
        import io
        import pickle

        class _PlainOnly(pickle.Unpickler):   # the dump is plain dicts/lists/str/int: build no object
            def find_class(self, module, name):
                raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

        raw = torch._C._distributed_c10d._dump_nccl_trace(True, False, False)
        dump = _PlainOnly(io.BytesIO(raw)).load()
    except Exception:
        return None
    groups: dict = {}
    for e in dump.get("entries", []):
        if e.get("is_p2p"):
            continue
        g = groups.setdefault(str(e.get("process_group", ["?"])[0] if isinstance(e.get("process_group"), (list, tuple))
                                  else e.get("process_group")), {"last_completed": -1, "last_started": -1,
                                                                  "last_scheduled": -1, "first_open": None})
        seq = int(e.get("collective_seq_id", -1))
        state = e.get("state")
        g["last_scheduled"] = max(g["last_scheduled"], seq)
        if state in ("started", "completed"):
            g["last_started"] = max(g["last_started"], seq)
        if state == "completed":
            g["last_completed"] = max(g["last_completed"], seq)
        elif g["first_open"] is None or seq < g["first_open"]["seq"]:
            g["first_open"] = {"seq": seq, "op": e.get("profiling_name"), "state": state,
                               "sizes": e.get("input_sizes")}
    return {"version": dump.get("version"), "groups": groups} if groups else None


def open_store(timeout: float, prefix: str):
    """A store client of our own on the rendezvous store (thread-safe use: one client per thread)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        base = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    else:  # file:// or other init methods: reuse the default group's store
        base = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(prefix, base)


def run_prefix() -> str:
    return (f"tpprobe/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")


class Channel:
    """JSON posts keyed by name and rank on the store; waits poll with a deadline."""

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    def post(self, key: str, obj, rank: Optional[int] = None) -> None:
        self.store.set(f"{key}/{self.rank if rank is None else rank}", json.dumps(obj))

    def get(self, key: str, rank: int):
        k = f"{key}/{rank}"
        if not self.store.check([k]):
            return None
        return json.loads(self.store.get(k))

    def collect_rank(self, key: str, rank: int, deadline: float, poll: float = 0.05):
        while True:
            late = time.time() >= deadline
            v = self.get(key, rank)
            if v is not None or late:       # the clock read first: a post before the deadline is seen
                return v
            time.sleep(poll)

    def collect(self, key: str, deadline: float, stop_early=None, poll: float = 0.05) -> dict[int, dict]:
        """Every rank's post under key, waiting until `deadline` (time.time()) for missing ones.

        stop_early(found) -> bool ends the wait before the deadline (e.g. the missing ranks are
        known to be stuck)."""
        found: dict[int, dict] = {}

        def read():
            for r in range(self.world):
                if r not in found:
                    v = self.get(key, r)
                    if v is not None:
                        found[r] = v
        while True:
            read()
            if len(found) == self.world or time.time() >= deadline:
                return found
            if stop_early is not None and stop_early(found):
                # what made it stop (a peer's stall, crash, silence) was read after the posts were:
                # a post that landed in between is read now, never missed
                read()
                return found
            time.sleep(poll)


# phases in which a rank is not stuck once rank 0's verdict is out: rank 0 writing it, a rank
# waiting to read it, a rank on its way out
NOT_STUCK = ("report", "verdict", "done")


class Watchdog(threading.Thread):
    """Heartbeats, stall reports, and the end of a rank stuck after the verdict."""

    def __init__(self, channel: Channel, progress: Progress, stall: float, interval: float = 0.25,
                 end_stuck: bool = True):
        super().__init__(daemon=True, name="tpprobe-watchdog")
        self.ch, self.progress, self.stall, self.interval = channel, progress, stall, interval
        # False for a caller that probes again in this process (tests' kept groups): a rank only slow
        # to reach "report" after the verdict must come back to it, not vanish
        self.end_stuck = end_stuck
        self.done = threading.Event()
        self.stall_posted = False
        self.fr_posted = False
        self._pending: Optional[tuple] = None     # (seq, when first seen pending)

    def _device_collective(self, p: Progress) -> Optional[dict]:
        """The all-reduce the device is blocked in: the first one not completed, pending for as long
        as the watchdog has seen it so (CUDA events, not host timestamps), while the host no longer
        issues work (the forward has returned, or a later pending one would replace it)."""
        seq = p.device_pending()
        if seq is None:
            self._pending = None
            return None
        if self._pending is None or self._pending[0] != seq:
            self._pending = (seq, time.time())
        audit = p.audit or []
        meta = audit[seq].meta() if seq < len(audit) else {"seq": seq}
        return {**meta, "since": self._pending[1], "from": "cuda-event"}

    def run(self) -> None:
        while not self.done.is_set():
            try:
                p = self.progress
                hb = {"t": time.time(), "phase": p.phase, "where": p.where, "collective": p.collective}
                if p.events:
                    c = self._device_collective(p)
                    hb["issued"], hb["done"] = len(p.audit or []), p.device_done()
                    hb["collective"] = hb["collective"] or c
                else:
                    c = p.collective
                self.ch.post("hb", hb)
                if self.ch.get("fr-request", 0) is not None and not self.fr_posted:
                    self.ch.post("fr", flight_recorder() or {})
                    self.fr_posted = True
                if c and not self.stall_posted and time.time() - c["since"] > self.stall:
                    audit = [a.meta() for a in list(p.audit or [])]
                    self.ch.post("stall", {"t": time.time(), "collective": c, "where": p.where, "audit": audit})
                    self.stall_posted = True
                final = self.ch.get("final", 0)
                if final is not None and p.phase not in NOT_STUCK and self.end_stuck:
                    # the verdict is out and this rank's main thread is still stuck: end it, with SGLang's
                    # shared-memory names unlinked first (file operations only: no group is torn down under
                    # a main thread that may be blocked in one of its collectives)
                    unlink_engine_segments()
                    os._exit(int(final.get("code", 1)))
            except Exception:
                # the store is gone (the launcher ended): nobody is left to report to
                return
            # wake at once when the phase changes (a rank can die within one interval)
            self.progress.changed.wait(self.interval)
            self.progress.changed.clear()

    def stop(self) -> None:
        self.done.set()
        self.progress.changed.set()


def agree_out_dir(opts, ctx, ch) -> tuple[str, bool]:
    """Rank 0 picks the folder (the launcher passes it down); every rank uses the same one.
    Also returns whether this rank created it (then a run that fails early removes it again)."""
    from ..formats.capture_dir import check_out_dir, default_out_dir
    if ctx.rank == 0:
        out = opts.out or default_out_dir()
        created = not Path(out).is_dir()
        check_out_dir(Path(out), 0)
        ch.post("out", {"out": out}, rank=0)
        return out, created
    deadline = time.time() + opts.timeout
    v = None
    while v is None and time.time() < deadline:
        v = ch.get("out", 0)
        if v is None and ch.get("ready", 0) is not None:   # rank 0 failed before choosing, or posted
            v = ch.get("out", 0)                           # "out" just after the first read (it posts
            break                                          # "out" before "ready": read it once more)
        time.sleep(0.05)
    if v is None:
        raise UsageError("rank 0 did not say where to write the capture (did it fail to start?)")
    Path(v["out"]).mkdir(parents=True, exist_ok=True)   # another node: rank 0 checked the path on its own
    return v["out"], False


def await_final(ch: Channel, wait: float) -> int:
    """The exit code rank 0 posted (1 if it never did within `wait` seconds)."""
    v = ch.collect_rank("final", 0, time.time() + wait)
    return int(v["code"]) if v else 1


def unlink_engine_segments() -> None:
    """The shared-memory segments SGLang's groups created in this process, closed and unlinked (a segment
    left registered makes Python's resource tracker warn of a leak at exit)."""
    import sys
    if "tpprobe.engines.sglang.dist" in sys.modules:     # SGLang's model ran here
        sys.modules["tpprobe.engines.sglang.dist"].release_shared_memory()


def shutdown(ctx) -> None:
    import sys
    unlink_engine_segments()      # the engines' shared memory goes first
    if "tpprobe.engines.vllm.cpu_mode" in sys.modules:     # vLLM's groups (and their shared memory) likewise
        sys.modules["tpprobe.engines.vllm.cpu_mode"].release()
    try:
        if dist.is_initialized():
            # let every rank read the verdict before the store's host (rank 0's agent) may go; at
            # world 1 too: NCCL warns at exit about a group that was never destroyed
            dist.destroy_process_group()
    except Exception:
        pass


def local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def agree_ready(ch: Channel, world: int, timeout: float) -> list[dict]:
    """Wait for every rank's "ready" post; the failures ({"error", "code"}), late ranks included."""
    peers = ch.collect("ready", time.time() + timeout,
                       stop_early=lambda found: any(not v.get("ok") for v in found.values()))
    bad = [v for r, v in sorted(peers.items()) if not v.get("ok")]
    if not bad and len(peers) < world:
        late = [r for r in range(world) if r not in peers]
        bad = [{"error": f"ranks {late} did not build the model within --timeout {timeout:g}s", "code": 1}]
    return bad


def post_ready(ch: Channel, rank: int, debug: bool, prepare) -> None:
    """Run `prepare()` and post "ready": ok, or its error with the exit code every rank will end with
    (a UsageError: 2; anything else, a bug in tpprobe or a broken install: 3). With --debug the
    traceback travels in the post, so the rank that reports prints one traceback above its one line
    (each rank printing its own interleaved them, and a rank ended mid-print left a torn last line)."""
    import traceback
    try:
        prepare()
        ch.post("ready", {"ok": True})
    except UsageError as e:
        ch.post("ready", {"ok": False, "error": str(e), "code": 2,
                          **({"traceback": traceback.format_exc()} if debug else {})})
    except Exception as e:      # tpprobe's own failure to build (or a broken install): exit 3
        ch.post("ready", {"ok": False, "error": internal_line(e, rank, "build"), "code": INTERNAL_EXIT,
                          "internal": True, **({"traceback": traceback.format_exc()} if debug else {})})


def start_channels(ctx: RankContext, timeout: float, progress, end_stuck: bool = True) -> tuple[Channel, "Watchdog"]:
    """The store channel the pipeline posts on, and the watchdog thread (started) that posts this
    rank's heartbeats and stalls on a channel of its own."""
    ch = Channel(open_store(timeout, run_prefix()), ctx.rank, ctx.world_size)
    watchdog = Watchdog(Channel(open_store(timeout, run_prefix()), ctx.rank, ctx.world_size), progress,
                        stall=min(5.0, max(1.0, timeout / 4)), end_stuck=end_stuck)
    watchdog.start()
    return ch, watchdog
