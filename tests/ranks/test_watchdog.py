"""The watchdog ends a rank stuck after rank 0's verdict, and only a stuck one: a rank waiting to read
the verdict goes on to its own shutdown (where an engine's shared memory is released). Real
processes on a real TCPStore: the watchdog's os._exit would end the test process itself."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.ranks import ROOT

_RANK = r"""
import sys, time
from datetime import timedelta
import torch.distributed as dist
from tpprobe.capture.progress import Progress
from tpprobe.exchange.dist import Channel, Watchdog

store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=30),
                      wait_for_workers=False)
Channel(store, 0, 2).post("final", {"code": 1})              # rank 0's verdict is out: findings
progress = Progress()
progress.set(sys.argv[1])
dog = Watchdog(Channel(store, 1, 2), progress, stall=5.0, interval=0.05)
dog.start()
time.sleep(1.0)                     # twenty of the watchdog's turns
dog.stop()
print("went on", flush=True)
"""


@pytest.mark.parametrize("phase, ended", [("verdict", False), ("done", False), ("exchange", True), ("forward", True)])
def test_the_watchdog_ends_only_a_rank_stuck_after_the_verdict(phase, ended):
    p = subprocess.run([sys.executable, "-c", _RANK, phase], capture_output=True, text=True, cwd=ROOT, timeout=60)
    if ended:       # stuck in the exchange or the forward: ended with rank 0's code, nothing after it ran
        assert (p.returncode, p.stdout) == (1, ""), (p.returncode, p.stdout, p.stderr[-2000:])
    else:
        assert (p.returncode, p.stdout) == (0, "went on\n"), (p.returncode, p.stdout, p.stderr[-2000:])
