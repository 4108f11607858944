"""`--model tests.zoo.threads:NAME` factories that do what a fork cannot promise to survive, and a rank
that will not stop.

- `pool_loader`: builds the built-in model while a thread pool runs torch ops, the way transformers'
  weight loader does ("Loading weights" on GLOBAL_WORKERS threads, each converting tensors): every
  worker thread's first parallel op sets up the intra-op pool, all at once.
- `stubborn_hang`: rank 1 ignores SIGTERM and blocks forever in its first forward; only a SIGKILL
  from whoever started it ends it.
- `threads_seen`: the built-in model, each rank writing the thread count torch runs it on to
  $THREADS_SEEN_DIR/rank-N.
The factories also run inside the test runner's ranks (`pool_loader_rank`).
"""
from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tpprobe import ProbeTarget, RankContext
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin

WORKERS = 8


def load_on_threads(workers: int = WORKERS) -> float:
    """What a threaded weight loader does: `workers` threads started together, each running parallel
    torch ops (a matmul, a dtype conversion) as its first act."""
    start = threading.Barrier(workers)

    def convert(i: int) -> float:
        w = torch.randn(192, 192, generator=torch.Generator().manual_seed(i))
        start.wait()
        return float((w @ w).to(torch.bfloat16).float().sum())

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return sum(pool.map(convert, range(workers)))


def pool_loader(ctx: RankContext) -> ProbeTarget:
    load_on_threads()
    return build_builtin(ctx, BuiltinConfig(layer_ids=[-1, 1, 3]))


def pool_loader_rank(rank: int, world: int) -> int:
    """The same load inside a test-runner rank (tests.helpers.ranks.spawn); returns the thread count torch sees."""
    load_on_threads()
    torch.distributed.barrier()
    return torch.get_num_threads()


def _block_forever(module, args):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()


def stubborn_hang(ctx: RankContext) -> ProbeTarget:
    target = build_builtin(ctx, BuiltinConfig(layer_ids=[-1, 1, 3]))
    if ctx.rank == 1:
        target.model.layers[1].register_forward_pre_hook(_block_forever)
    return target


def stubborn_rank(rank: int, world: int, pids: str) -> None:
    """A test-runner rank: rank 1 ignores SIGTERM and blocks forever, rank 0 fails once rank 1 does.
    Each writes its pid into the folder `pids` first."""
    import os
    open(os.path.join(pids, str(os.getpid())), "w").close()
    if rank == 0:
        torch.distributed.barrier()
        raise RuntimeError("rank 0 fails on purpose")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.distributed.barrier()
    threading.Event().wait()


def threads_seen(ctx: RankContext) -> ProbeTarget:
    with open(os.path.join(os.environ["THREADS_SEEN_DIR"], f"rank-{ctx.rank}"), "w") as f:
        f.write(str(torch.get_num_threads()))
    return build_builtin(ctx, BuiltinConfig(layer_ids=[-1, 1, 3]))
