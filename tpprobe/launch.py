"""`tpprobe probe` without torchrun: start N local ranks through PyTorch's elastic launcher.

The ranks run `python -m tpprobe probe ...` exactly as torchrun would start them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by the agent), on a free local port.
"""
from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m tpprobe <argv>` on nproc local ranks; return the ranks' agreed exit code."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tpprobe", *argv)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return 2 if 2 in codes else 1
    return 0
