"""Liveness: ranks that are missing (died, hung, never started), stalled in a collective the others
never issued, or that failed with an error. Each becomes one root finding."""
from __future__ import annotations

from typing import Optional

from .collectives import extra_collective_place
from .findings import Finding


def flight_text(fr: Optional[dict]) -> str:
    """Which collective sequence number each rank's NCCL reached, from the flight recorders."""
    parts = []
    for r, v in sorted((fr or {}).items(), key=lambda kv: int(kv[0])):
        for g in (v.get("groups") or {}).values():
            t = f"rank {r} completed seq {g['last_completed']}"
            if g.get("first_open"):
                o = g["first_open"]
                t += f", seq {o['seq']} {o.get('op') or ''} {o.get('state') or ''}".rstrip()
            parts.append(t)
            break      # the default group (the model's) first
    return "; ".join(parts)


def missing_rank_findings(missing: dict, records: dict, live: list[int], counts: dict[int, int],
                          flight_recorder: Optional[dict] = None) -> list[Finding]:
    """One finding per missing rank: a collective-mismatch when it blocked in an all-reduce the
    live ranks never issued, else a rank-timeout with what its last heartbeat said."""
    ref = live[0]
    roots: list[Finding] = []
    for r, info in sorted(missing.items()):
        stall = info.get("stall")
        if info.get("crash"):
            c = info["crash"]
            roots.append(Finding("internal-error", c["step"], [r],
                                 detail=f"rank {r} hit an internal error in tpprobe in {c['step']}: {c['error']} "
                                        f"(a bug in tpprobe, not in the model: its record is missing here; "
                                        f"the rank's own line says how to report it)", evidence={"crash": c}))
        elif stall and all(counts[q] <= stall["collective"]["seq"] for q in live):
            c = stall["collective"]
            audit = stall.get("audit") or []
            where, extra_at = extra_collective_place(audit, records[ref].meta.collectives)
            if extra_at is not None and extra_at < len(audit) and extra_at != c["seq"]:
                a = audit[extra_at]
                text = (f"rank {r} issued an extra all-reduce #{extra_at} at {a['where']} ({a['module']}, shape "
                        f"{a['shape']}) that ranks {live} never issued; from there its collectives paired with "
                        f"the wrong ones and it blocked in #{c['seq']}, one more than the others' "
                        f"{max(counts.values())}")
            else:
                text = (f"rank {r} blocked in all-reduce #{c['seq']} ({c.get('module')}, shape {c.get('shape')}) "
                        f"that ranks {live} never issued (they issued {max(counts.values())})")
            roots.append(Finding("collective-mismatch", where or c.get("where", "?"), [r],
                                 detail=text + f"; rank {r} was stopped",
                                 evidence={"stall": stall, "counts": counts}))
        else:
            hb = info.get("heartbeat") or {}
            doing = f"{hb.get('phase', 'starting')}{': ' + hb['where'] if hb.get('where') else ''}"
            if hb.get("collective"):
                doing += f", in all-reduce #{hb['collective']['seq']} ({hb['collective'].get('module')})"
            if hb.get("done") is not None:     # NCCL: what its GPU completed (CUDA events)
                doing += (f"; its GPU had completed all-reduce #{hb['done']}" if hb["done"] >= 0
                          else "; its GPU had completed no all-reduce")
            fr = flight_text(flight_recorder)
            if fr:
                doing += f"; NCCL flight recorder: {fr}"
            state = info.get("state", "died or hung")
            roots.append(Finding(
                "rank-timeout", hb.get("phase") or "startup", [r],
                detail=(f"rank {r} {state}; its last heartbeat said: {doing}"
                        + (f", {info['silent_s']:.1f} s before the others gave up" if "silent_s" in info else "")
                        + "; the others stopped within the timeout"),
                evidence={"heartbeat": hb}))
    return roots


# what a rank's collective raises when a peer died or stopped answering: a consequence, never the cause
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Socket Timeout",
             "timed out", "Broken pipe", "NCCL communicator was aborted", "DistBackendError", "DistNetworkError")


def peer_gone(error: str) -> bool:
    return any(p in str(error) for p in PEER_GONE)


def rank_error_findings(errors: dict[int, str], roots: list[Finding], places: dict | None = None) -> list[Finding]:
    """A rank whose own forward raised is the root; the ranks whose collectives then failed because
    that peer stopped (gloo's "Connection closed by peer", a recv timeout) are its consequences, listed
    under it (under a missing or crashed rank's finding when there is one), never a failure of their own.
    `places`: rank -> the module its forward raised in ("layer K (module)"); ranks that raised the same
    error in the same module are one finding there."""
    causes = {r: e for r, e in errors.items() if not peer_gone(e)}
    after = {r: e for r, e in errors.items() if r not in causes}
    found = []
    for r, e in sorted(causes.items()):
        where = (places or {}).get(r) or "probe"
        same = next((f for f in found if where != "probe" and f.where == where and f.detail == str(e)[:300]), None)
        if same is not None:
            same.ranks.append(r)
        else:
            found.append(Finding("rank-error", where, [r], detail=str(e)[:300]))
    if not found and not roots:      # every error was a peer's absence, and no peer is known missing
        return [Finding("rank-error", "probe", [r], detail=str(e)[:300]) for r, e in sorted(errors.items())]
    head = (roots or found)[0]
    head.consequences += [f"rank {r}: its collective failed once the peer stopped ({str(e)[:160]})"
                          for r, e in sorted(after.items())]
    return found
