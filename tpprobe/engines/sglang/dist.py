"""Publish SGLang's parallel state over an ALREADY-initialized torch.distributed world.

The probe calls `torch.distributed.init_process_group` itself (gloo on CPU) before any model
factory runs. SGLang 0.5.23's `init_distributed_environment` skips `init_process_group` when the
default group exists and only builds its "world" GroupCoordinator over it (parallel_state.py:2487),
so the sequence below works on top of the probe's world, for any tp size = world size:

1. `publish(ServerArgs(tp_size=N, device=...), role="scheduler", ranks=SpawnRanks(world_rank=r))`
   fills `get_parallel()` (tp_rank/tp_size) the way a scheduler process does;
2. `init_distributed_environment(...)` -> SGLang's WORLD coordinator;
3. `set_custom_all_reduce(False)`, `initialize_model_parallel()` -> TP/PP/attn-TP/MoE groups.

SGLang's `GroupCoordinator.all_reduce` then ends in `torch.distributed.all_reduce` on the TP
coordinator's `device_group` (a new gloo group over the same ranks). Tear down with
`torch.distributed.destroy_process_group()` (SGLang's destroy_model_parallel imports uvicorn).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpprobe.core.errors import UsageError


def publish_parallel_state(rank: int, world_size: int, local_rank: int, backend: str,
                           device: str = "cpu", attn_dp: int = 1):
    """Make SGLang's TP state = the current torch.distributed world. Returns the TP
    GroupCoordinator. Idempotent within a process. attn_dp > 1: DP attention (SGLang's
    --enable-dp-attention --dp-size attn_dp), attention-TP groups of world_size // attn_dp ranks."""
    if not dist.is_initialized():
        raise UsageError("torch.distributed must be initialized before SGLang's parallel state "
                         "is published (the probe calls init_process_group first)")
    if dist.get_world_size() != world_size:
        raise UsageError(f"torch.distributed world has {dist.get_world_size()} ranks, "
                         f"expected tp={world_size}")
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    if ps._WORLD is not None and ps._TP is not None:
        return get_parallel().tp_group
    if attn_dp > 1 and world_size % attn_dp:
        raise UsageError(f"--dp-attention {attn_dp} does not divide tp={world_size}")
    extra = dict(dp_size=attn_dp, enable_dp_attention=True) if attn_dp > 1 else {}
    sa = ServerArgs(model_path="dummy", tp_size=world_size, device=device,
                    disable_custom_all_reduce=True, **extra)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=local_rank,
                                    distributed_init_method="env://", backend=backend)
    ps.set_custom_all_reduce(False)
    ps.initialize_model_parallel()
    if attn_dp > 1:
        from sglang.srt.layers.dp_attention import initialize_dp_attention

        initialize_dp_attention(sa)
    tp = get_parallel().tp_group
    if tp.world_size != world_size or tp.rank_in_group != rank:
        raise RuntimeError(f"SGLang TP group is rank {tp.rank_in_group}/{tp.world_size}, "
                           f"expected {rank}/{world_size}")
    return tp


def publish_for(ctx, attn_dp: int = 1):
    """publish_parallel_state from a tpprobe RankContext."""
    dev = ctx.device.type if isinstance(ctx.device, torch.device) else str(ctx.device)
    return publish_parallel_state(ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, dev, attn_dp)


def release_shared_memory() -> None:
    """Unlink the shared memory SGLang's parallel state holds, before the process exits.

    Each GroupCoordinator with more than one rank builds a MessageQueue broadcaster
    (SGLANG_USE_MESSAGE_QUEUE_BROADCASTER, on by default) whose ring buffer the group's first rank
    creates as a shared_memory segment. Only ShmRingBuffer.__del__ unlinks it, and the coordinators
    are module globals that live until interpreter shutdown, so the segment stays registered with
    multiprocessing's resource_tracker, which then warns "leaked shared_memory objects" at exit.
    SGLang's destroy_model_parallel would drop them but imports the HTTP server stack; this does
    the one thing needed."""
    import sys
    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    if ps is None:
        return
    seen = set()
    for g in list(vars(ps).values()):
        mq = getattr(g, "mq_broadcaster", None)
        if mq is None or id(g) in seen:
            continue
        seen.add(id(g))
        g.mq_broadcaster = None
        buf = getattr(mq, "buffer", None)
        # ShmRingBuffer.__del__ then has nothing left to do (popped once, whichever thread gets here first)
        shm = vars(buf).pop("shared_memory", None) if buf is not None else None
        if shm is None:
            continue
        if getattr(buf, "is_creator", False):
            try:
                shm.unlink()           # the name, and its resource-tracker entry, whatever close() says
            except OSError:
                pass
        try:
            shm.close()
        except (OSError, BufferError):
            pass
