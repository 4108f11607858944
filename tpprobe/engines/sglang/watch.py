"""The SGLang side of the watch (tpprobe/engines/watch.py): this scheduler's TP rank, its group's CPU group and
the Tap extensions of an SGLang model, for the plugin's forward (tpprobe/engines/sglang/plugin.py), and the
live toggle through the hook SGLang offers for it: `Engine.collective_rpc(method, **kwargs)` reaches every
scheduler's `handle_rpc_request`, which the plugin wraps (SGLang's HookRegistry, AROUND) to answer
`tpprobe_watch` (n=N) and `tpprobe_status` itself; SGLang returns only success to the caller, so each rank
logs its status in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

RPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
METHODS = ("tpprobe_watch", "tpprobe_status")
# process-wide by nature: one SGLang scheduler process serves one TP rank; its Side is built once
_SIDE: dict = {"side": None}


def side(s: dict, tp_rank_world_group, parallel_ranks):
    """This rank's Side: `tp_rank_world_group()` and `parallel_ranks()` are the plugin's (engines/sglang/plugin.py)."""
    if _SIDE["side"] is None:
        from tpprobe.engines.sglang.stream import sglang_extensions
        from tpprobe.engines.watch import Side

        rank, world, group = tp_rank_world_group()

        def setup(tap):
            tap.stream_from_layer_output = False    # 0.5.23 layers return an owed output (the plugin's reason)
        _SIDE["side"] = Side(rank=rank, world=world, cpu_group=getattr(group, "cpu_group", None), par=parallel_ranks(),
                             extensions=sglang_extensions(), source="sglang-watch",
                             backend="sglang (live server, watch)", root=Path(s["dir"]), max_bytes=s["max_bytes"],
                             tap_setup=setup)
    return _SIDE["side"]


def watch_forward(s: dict, model, run, input_ids, mode: str, step: int, tp_rank_world_group, parallel_ranks):
    """One checked forward of SGLang's model on this scheduler's TP rank."""
    from tpprobe.engines import watch

    try:
        sd = side(s, tp_rank_world_group, parallel_ranks)
    except Exception as e:  # noqa: BLE001 - no TP group to read here
        watch.stop(f"SGLang's TP group not readable: {type(e).__name__}: {e}")
        return run()
    return watch.forward(sd, model, run, input_ids, mode, step)


def handle_rpc(original_fn, scheduler, recv_req, *args, **kwargs):
    """AROUND SGLang's `Scheduler.handle_rpc_request`: tpprobe's methods answered here (every scheduler of the TP
    group, then SGLang's own barrier on its CPU group, as SGLang does after its methods); others go on to SGLang."""
    method = getattr(recv_req, "method", None)
    if method not in METHODS:
        return original_fn(scheduler, recv_req, *args, **kwargs)
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import RpcReqOutput

    from tpprobe.engines import watch

    ok, message = True, ""
    try:
        params = recv_req.parameters or {}
        st = watch.set_every(int(params.get("n", 0))) if method == "tpprobe_watch" else watch.status()
        message = json.dumps(st, default=str)
        watch.say(f"{method}: {message}")
    except Exception as e:  # noqa: BLE001 - an RPC's error goes back to the caller, never into the server
        ok, message = False, f"{type(e).__name__}: {e}"
    group = getattr(getattr(scheduler, "tp_group", None), "cpu_group", None)
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)
    return RpcReqOutput(success=ok, message=message)
