"""The vLLM side of the watch (tpprobe/engines/watch.py): this worker's TP rank, its group's CPU group and
the Tap extensions of a vLLM model, for the worker's forward (tpprobe/engines/vllm/worker.py)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

# process-wide by nature: one vLLM worker process serves one TP rank; its Side is built once
_SIDE: dict = {"side": None}


def side(s: dict, parallel_ranks):
    """This rank's Side: `parallel_ranks()` is the worker's (engines/vllm/worker.py)."""
    if _SIDE["side"] is None:
        from vllm.distributed.parallel_state import get_tp_group

        from tpprobe.engines.vllm.audit import vllm_extensions
        from tpprobe.engines.watch import Side

        tp = get_tp_group()
        _SIDE["side"] = Side(rank=tp.rank_in_group, world=tp.world_size, cpu_group=tp.cpu_group,
                             par=parallel_ranks(), extensions=vllm_extensions(), source="vllm-watch",
                             backend="vllm (live engine, watch)", root=Path(s["dir"]), max_bytes=s["max_bytes"])
    return _SIDE["side"]


def watch_forward(s: dict, model, run, input_ids, mode: str, step: int, parallel_ranks):
    """One checked forward of vLLM's model (the watch's `forward`), on this worker's TP rank."""
    from tpprobe.engines import watch

    try:
        sd = side(s, parallel_ranks)
    except Exception as e:  # noqa: BLE001 - no TP group to read here: the watch stops on this process alone
        watch.stop(f"vLLM's TP group not readable: {type(e).__name__}: {e}")
        return run()
    with eager_forward():
        return watch.forward(sd, model, run, input_ids, mode, step)


@contextmanager
def eager_forward():
    """A checked forward of vLLM's compiled path runs the model's own Python forward: vLLM's
    `ForwardContext.skip_compiled` (its way past the compiled graph, `support_torch_compile.__call__`), so the
    Tap's hooks and the coordinator door see every layer and reduce; the next forward is compiled again. In the
    eager path (and outside a forward context) nothing changes."""
    ctx = None
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            ctx = get_forward_context()
    except Exception:  # noqa: BLE001 - another vLLM: the forward as it runs
        ctx = None
    before = getattr(ctx, "skip_compiled", None)
    if ctx is not None and before is not None:
        ctx.skip_compiled = True
    try:
        yield
    finally:
        if ctx is not None and before is not None:
            ctx.skip_compiled = before
