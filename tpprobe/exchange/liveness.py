"""Why a rank is missing, from what it left in the store: its heartbeats, a stall post, its
"ready". The probe stops waiting early once every missing rank is explained, and the checks name
each missing rank from `missing_info` (died, hung, never started).
"""
from __future__ import annotations

import time

from .dist import Channel, flight_recorder

# a rank whose last heartbeat is older than this is taken as dead (the watchdog posts every ~0.5 s)
DEAD_AFTER_S = 3.0
# a rank that went silent less than this long ago is alive but not progressing: hung
HUNG_UNDER_S = 2.0


def all_missing_explained(ch: Channel, found: dict, world: int) -> bool:
    """Stop waiting early when every missing rank is known dead (silent) or stalled in a collective
    none of the others will issue."""
    now = time.time()
    for r in range(world):
        if r in found or ch.get("crash", r) is not None:
            continue
        stall = ch.get("stall", r)
        if stall and all(p["n_allreduce"] <= stall["collective"]["seq"] for p in found.values()):
            continue
        hb = ch.get("hb", r)
        if hb is not None and now - hb["t"] > DEAD_AFTER_S:
            continue
        return False
    return bool(found)


def missing_info(ch: Channel, r: int, posts: dict) -> dict:
    hb, stall = ch.get("hb", r), ch.get("stall", r)
    ready = ch.get("ready", r)
    if hb is None:          # read after "ready": a heartbeat posted between the two reads is seen
        hb = ch.get("hb", r)
    info = {"heartbeat": hb, "stall": stall}
    crash = ch.get("crash", r)
    if crash is not None:      # tpprobe's own code failed on that rank (probe/pipeline.py _internal_error)
        info["crash"] = crash
        info["state"] = f"hit an internal error in tpprobe in {crash['step']}: {crash['error']}"
    elif hb is None and ready is not None:
        info["heartbeat"] = {"phase": "forward"}
        info["state"] = "died (it built its model, then went silent)"
    elif hb is None:
        info["state"] = "never started the probe (no heartbeat)"
    else:
        info["silent_s"] = time.time() - hb["t"]
        info["state"] = "hung (alive, no progress)" if info["silent_s"] < HUNG_UNDER_S else "died (heartbeat stopped)"
    return info


def collect_meta(ch: Channel, world: int, deadline: float) -> dict:
    """Every rank's metadata post, until the deadline or until every missing rank is explained."""
    return ch.collect("meta", deadline, stop_early=lambda found: all_missing_explained(ch, found, world))


def flight_recorders(ch: Channel, world: int, grace: float, own: dict | None = None) -> dict:
    """Rank 0: every live rank's NCCL flight recorder summary (its watchdog posts it on request):
    which collective sequence number each rank's NCCL scheduled, started and completed."""
    ch.post("fr-request", {}, rank=0)
    alive = {r for r in range(world) if r != 0 and ch.get("meta", r) is not None}
    got = ch.collect("fr", time.time() + min(1.5, grace), stop_early=lambda found: alive <= set(found))
    got[0] = own or flight_recorder() or {}
    return {r: v for r, v in sorted(got.items()) if v}


def liveness_of(ch: Channel, world: int, posts: dict, grace: float, backend: str, own_flight=None) -> dict:
    """Rank 0: why each missing rank is missing and, over NCCL when a rank is missing or failed,
    every live rank's flight recorder."""
    live = {"missing": {r: missing_info(ch, r, posts) for r in range(world) if r not in posts}}
    if backend == "nccl" and (live["missing"] or any(p["status"] != "ok" for p in posts.values())):
        live["flight_recorder"] = flight_recorders(ch, world, grace, own_flight)
    return live
