"""`tpprobe probe` without torchrun: start N local ranks through PyTorch's elastic launcher;
`tpprobe torchrun`: torchrun itself (every option of it), ending like a tpprobe command.

The ranks run `python -m tpprobe probe ...` exactly as torchrun would start them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by the agent), on a free local port.
"""
from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def _quiet_agent() -> None:
    """The agent logs a failed worker as an error; a finding (exit 1) is not one: the report says it."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _agreed_code(e: ChildFailedError) -> int:
    """Bad usage (2) over an internal error (3) over findings (1); a rank killed by a signal: 1."""
    from .errors import INTERNAL_EXIT
    codes = [f.exitcode for f in e.failures.values()]
    return 2 if 2 in codes else INTERNAL_EXIT if INTERNAL_EXIT in codes else 1


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m tpprobe <argv>` on nproc local ranks; return the ranks' agreed exit code."""
    _quiet_agent()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tpprobe", *argv)
    except ChildFailedError as e:
        return _agreed_code(e)
    return 0


COMMANDS = ("probe",)   # what `tpprobe torchrun` may start on the ranks


def torchrun(argv: list[str]) -> int:
    """`torchrun [its options] -m tpprobe COMMAND [options]`, with torchrun's own parser and launch,
    ending like a tpprobe command: 0 healthy, 1 findings, 2 bad usage, and no ChildFailedError
    traceback (plain torchrun prints one whenever a rank exits non-zero, a finding included)."""
    from .errors import UsageError
    cut = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if cut is None:
        raise UsageError("tpprobe torchrun: name the command after torchrun's options, e.g. "
                         "tpprobe torchrun --nproc-per-node 4 probe --layers -1,1,3")
    from torch.distributed.run import parse_args, run
    import contextlib
    import io
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parse_args([*argv[:cut], "-m", "tpprobe", *argv[cut:]])
    except SystemExit as e:      # argparse's usage block: keep its last line, the reason
        why = (said.getvalue().strip().splitlines() or ["bad options"])[-1].split("error: ", 1)[-1]
        raise UsageError(f"tpprobe torchrun: torchrun's options: {why} "
                         f"(python -m torch.distributed.run --help lists them)") from e
    _quiet_agent()
    try:
        run(args)
    except ChildFailedError as e:
        return _agreed_code(e)
    return 0
