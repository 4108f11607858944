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
    # the collective this rank is blocked in, if any: (its record, time.time() at its issue), set by the
    # audit at every collective; `collective` makes the dict the watchdog posts only when it reads it
    issued: Optional[tuple] = None
    since: float = field(default_factory=time.time)
    audit: Optional[list] = None            # this rank's all-reduce records so far (for stall posts)
    # CUDA tensors: (seq, event recorded on the stream right after all-reduce #seq). The host does
    # not block in an NCCL collective, so what the device completed is read from these events
    events: list = field(default_factory=list, repr=False)
    _done: int = -1

    changed: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def collective(self) -> Optional[dict]:
        """The collective this rank is blocked in, if any: seq, module, where, shape, since, kind."""
        c = self.issued
        if c is None:
            return None
        rec, since = c
        return {"seq": rec.seq, "module": rec.module, "where": rec.where, "shape": list(rec.shape),
                "since": since, "kind": rec.kind}

    def device_done(self) -> int:
        """The last all-reduce the device completed (-1: none), from the events (never blocks; one
        stream, so they complete in order)."""
        ev = self.events
        i = self._done + 1
        while i < len(ev):
            try:
                if not ev[i][1].query():
                    break
            except Exception:
                break
            i += 1
        self._done = i - 1
        return ev[self._done][0] if self._done >= 0 else -1

    def device_pending(self) -> Optional[int]:
        """The first all-reduce issued on the device and not completed, if any."""
        done = self.device_done()
        return done + 1 if self.events and done + 1 <= self.events[-1][0] else None

    def set(self, phase: str, where: str = "") -> None:
        if phase != self.phase:
            self.changed.set()        # the watchdog posts a heartbeat now, not an interval later
        self.phase, self.where, self.since = phase, where, time.time()
