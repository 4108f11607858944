"""The timing loop the benches share.

Every ratio a bench prints is measured side by side in one run: warm-up rounds first (compiles,
caches), then `iters` rounds over every variant, the order reversed every other round so that a
drift of the machine hits all variants alike, and the median of each variant's timings. Ratios
from different runs (different hosts, different loads) are not compared.
"""
import json
import os
import statistics
import time
from typing import Callable, Sequence


def alternate(variants: Sequence[str], run: Callable[[str], float], iters: int,
              warmup: int = 1) -> dict[str, list[float]]:
    """{variant: [one measurement per round]}: ``run(v)`` runs variant ``v`` once and returns its
    measurement (seconds, or a dict of seconds by phase)."""
    variants = list(variants)
    for _ in range(warmup):
        for v in variants:
            run(v)
    times = {v: [] for v in variants}
    for i in range(iters):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            times[v].append(run(v))
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {v: statistics.median(ts) for v, ts in times.items()}


def paired(times: dict[str, list[float]], base: str = "off") -> dict[str, tuple[float, float, float]]:
    """{variant: (first quartile, median, third quartile) of its round-by-round ratio to ``base``}.
    The two timings of a round are a few forwards apart, so a host whose speed drifts within the run
    (the lent GPU host's bare decode forward ranged 3.5 to 9 ms in one run) moves both alike; a ratio
    of the two medians can take them from different phases of the drift."""
    out = {}
    for v, ts in times.items():
        if v == base:
            continue
        r = sorted(t / b for t, b in zip(ts, times[base]))
        q1, q2, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else (r[0], r[0], r[0])
        out[v] = (q1, q2, q3)
    return out


def repeat(fn: Callable[[], object], n: int, warmup: int = 1) -> list[float]:
    """Seconds of ``n`` calls of ``fn`` (perf_counter), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def write_json(out: str, name: str, obj) -> str:
    """Write ``obj`` to ``out/name`` (the folder created) and return the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


def settled(forward: Callable[[], object], change: Callable[[], object]) -> None:
    """change() (the audit's kernels released or registered again), then one untimed ``forward()``.
    Registering walks the whole dispatcher and releasing destroys libraries: the forward right after
    either runs cold, model ops and all (about 1.4x slower at hidden 64 on the 2-core dev VM), so no
    timed forward may follow one directly, or whichever variant follows ``off`` pays for it."""
    change()
    forward()

