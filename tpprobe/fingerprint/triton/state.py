"""What the fused path keeps between batches (device facts, sign tables, launch entries, buffers)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class State:
    """Caches that outlive one forward's `Batch`: built once per process (per device, shape and
    (seed, k, knobs)) and reused by every later batch.  ``reset()`` empties them (tests)."""
    cc: dict = field(default_factory=dict)          # device index -> compute capability
    nsm: dict = field(default_factory=dict)         # device index -> multiprocessors
    signs: dict = field(default_factory=dict)       # (seed, k, kp, device) -> [128, kp] column signs
    entries: dict = field(default_factory=dict)     # (seed, k, knobs) -> {(shape, dtype, device): Entry}
    free: dict = field(default_factory=dict)        # device -> partial buffers a finished batch gave back
    want: dict = field(default_factory=dict)        # device -> words the last batch needed
    pinned: dict = field(default_factory=dict)      # device index -> pinned host buffer for the one copy
    pinned_view: dict = field(default_factory=dict)  # device index -> (buffer, n, its first n words, as numpy)
    staging: dict = field(default_factory=dict)     # device -> the device combine's Staging
    combine_launch: dict = field(default_factory=dict)   # (device, CB) -> the combine's DirectLaunch
    combine_why: list = field(default_factory=list)  # why the device combine was given up (host from then on)

    def reset(self) -> None:
        for f in fields(self):
            getattr(self, f.name).clear()


STATE = State()     # process-wide: device facts and compiled entries outlive any one run (reset() for tests)
