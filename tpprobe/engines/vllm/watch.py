"""The vLLM side of the watch (tpprobe/engines/watch.py): this worker's TP rank, its group's CPU group and
the Tap extensions of a vLLM model, for the worker's forward (tpprobe/engines/vllm/worker.py)."""
from __future__ import annotations

from pathlib import Path

# process-wide by nature: one vLLM worker process serves one TP rank; its Side is built once
_SIDE: dict = {"side": None}


def side(s: dict):
    if _SIDE["side"] is None:
        from vllm.distributed.parallel_state import get_tp_group

        from tpprobe.engines.vllm.audit import vllm_extensions
        from tpprobe.engines.vllm.worker import parallel_ranks
        from tpprobe.engines.watch import Side

        tp = get_tp_group()
        _SIDE["side"] = Side(rank=tp.rank_in_group, world=tp.world_size, cpu_group=tp.cpu_group,
                             par=parallel_ranks(), extensions=vllm_extensions(), source="vllm-watch",
                             backend="vllm (live engine, watch)", root=Path(s["dir"]), max_bytes=s["max_bytes"])
    return _SIDE["side"]


def watch_forward(s: dict, model, run, input_ids, mode: str, step: int):
    """One checked forward of vLLM's model (the watch's `forward`), on this worker's TP rank."""
    from tpprobe.engines import watch

    try:
        sd = side(s)
    except Exception as e:  # noqa: BLE001 - no TP group to read here: the watch stops on this process alone
        watch.stop(f"vLLM's TP group not readable: {type(e).__name__}: {e}")
        return run()
    return watch.forward(sd, model, run, input_ids, mode, step)
