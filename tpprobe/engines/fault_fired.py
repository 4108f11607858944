"""Whether each `--inject` fault fired: a fault that never acted leaves a healthy model, and its run must never read
HEALTHY.

Each fault is applied inside `injecting(spec)`. A fault that waits for something at run time (a reduce of one tensor,
a capture, a call number, a rank's turn) takes `counter(where)` while it is applied and calls it each time it acts;
`where` says where it looks, for the line said when it never acted. A fault that changes the model once as it is
applied (a flag, a weight, a hook on a module every forward runs) takes no counter: it counts as fired once. The
rank's record carries the counts (`KEY`), and `unfired_line` reads them from every rank.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

KEY = "inject_fired"          # the rank record's key: {spec: {"count": n, "where": text}}

_counts: dict[str, dict] = {}
_now: dict = {"spec": None}


def reset() -> None:
    """A new probe in this process (a caller that probes twice on one group)."""
    _counts.clear()


@contextmanager
def injecting(spec: str) -> Iterator[None]:
    """Apply the fault `spec` (`name@arg`) inside this block."""
    _now["spec"] = spec
    try:
        yield
    finally:
        _now["spec"] = None
        _counts.setdefault(spec, {"count": 1, "where": None})      # no counter taken: fired as applied


def counter(where: str) -> Callable[[], None]:
    """The function the fault being applied calls each time it acts; a no-op outside `injecting` (a live server's
    plugin injects without a probe to tell)."""
    spec = _now["spec"]
    if spec is None:
        return lambda: None
    entry = _counts.setdefault(spec, {"count": 0, "where": where})
    entry["count"], entry["where"] = 0, where

    def fire() -> None:
        entry["count"] += 1
    return fire


def counts() -> dict:
    """This rank's counts, for its record."""
    return {s: dict(v) for s, v in _counts.items()}


def unfired_line(inject: list, world: int, ranks: dict) -> Optional[str]:
    """One line naming each --inject fault that fired on no rank, and where it looked; None when each fired, when a
    rank is missing or did not finish its forward (that failure is the run's verdict), or when a record predates the
    counts. `ranks`: rank -> (its status, its counts: `KEY` of its record)."""
    if not inject or len(ranks) != world or any(st != "ok" or not isinstance(c, dict) for st, c in ranks.values()):
        return None
    said = []
    for spec in inject:
        seen = [c[spec] for _, c in ranks.values() if isinstance(c.get(spec), dict)]
        if len(seen) != world or any(s.get("count", 0) for s in seen):
            continue
        where = next((s["where"] for s in seen if s.get("where")), None)
        on = "its one rank" if world == 1 else f"any of the {world} ranks"
        said.append(f"--inject {spec} did not fire on {on}"
                    + (f": it looks for {where}, and none came" if where else ""))
    if not said:
        return None
    return "; ".join(said) + ": the model ran unbroken, so this run gives no verdict"
