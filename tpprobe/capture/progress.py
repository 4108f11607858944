"""Where this rank is (phase, place, the collective it is blocked in): written cheaply by the hooks
and the pipeline, read by the watchdog thread that posts heartbeats and stalls."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Progress:
    """Shared with the watchdog thread: where this rank is, cheaply updated by the hooks."""
    phase: str = "start"
    where: str = ""
    collective: Optional[dict] = None       # the all-reduce this rank is blocked in, if any
    since: float = field(default_factory=time.time)
    audit: Optional[list] = None            # this rank's all-reduce records so far (for stall posts)

    changed: threading.Event = field(default_factory=threading.Event, repr=False)

    def set(self, phase: str, where: str = "") -> None:
        if phase != self.phase:
            self.changed.set()        # the watchdog posts a heartbeat now, not an interval later
        self.phase, self.where, self.since = phase, where, time.time()
