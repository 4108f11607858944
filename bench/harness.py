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



def call_prices(variants: Sequence[str], mode: dict, forward: Callable[[], object], call: Callable[[], object],
                per_forward: int, rounds: int, sync: Callable[[], object],
                start: Callable[[str], object] = lambda v: None, end: Callable[[], object] = lambda: None) -> dict:
    """What one call costs between a model's ops and alone (in_forward.py, launch_api.py): hooks in the
    model make ``per_forward`` calls of the kind ``mode["mode"]`` names ("off": none). Per variant, round by
    round: ``start(v)``, one ``forward()`` timed from a synchronised start to the device done, ``end()``;
    then ``call()`` (two calls of that kind) per_forward / 2 times in a row, timed the same way. Returns
    {"off_us", "rows": [{call, in_forward_us, q1, q3 (each round's difference from off / per_forward),
    alone_us}]}."""
    def run(v):
        start(v)
        mode["mode"] = v
        sync()
        t0 = time.perf_counter()
        forward()
        sync()
        t = time.perf_counter() - t0
        mode["mode"] = "off"
        end()
        return t

    def alone(v):
        start(v)
        mode["mode"] = v
        sync()
        t0 = time.perf_counter()
        for _ in range(per_forward // 2):
            call()
        t = time.perf_counter() - t0
        sync()
        mode["mode"] = "off"
        end()
        return t / per_forward

    times = alternate(variants, run, rounds, warmup=3)
    al = alternate(variants[1:], alone, rounds, warmup=3)
    out = {"off_us": statistics.median(times["off"]) * 1e6, "rows": []}
    for v in variants[1:]:
        d = sorted((t - b) / per_forward * 1e6 for t, b in zip(times[v], times["off"]))
        q1, q2, q3 = statistics.quantiles(d, n=4)
        out["rows"].append({"call": v, "in_forward_us": q2, "q1": q1, "q3": q3,
                            "alone_us": statistics.median(al[v]) * 1e6})
    return out
