"""Replicated parameters: a parameter every rank must hold alike (norm weights, anything marked
replicated) whose hash differs on some ranks is a stale or wrong copy."""
from __future__ import annotations

from collections import Counter

from .findings import Finding


def param_divergence(records, live) -> list[Finding]:
    params = {r: records[r].meta.params for r in live}
    found = []
    for name in params[live[0]]:
        hashes = {r: params[r][name].hash if name in params[r] else None for r in live}
        if None in hashes.values():
            continue   # unread on some rank (capture/params.py): named in a coverage warning, not compared
        if len(set(hashes.values())) > 1:
            common, n_common = Counter(hashes.values()).most_common(1)[0]
            known = params[live[0]][name].replicated
            if not known and n_common * 2 <= len(live):
                continue   # maybe a shard: only a strict majority of equal copies proves it replicated
            odd = [r for r, h in hashes.items() if h != common]
            if len(odd) * 2 == len(live):      # a tie: call the ranks other than the lowest one's group odd
                odd = [r for r in live if hashes[r] != hashes[live[0]]]
            layer = params[live[0]][name].layer
            # a DTensor parameter (capture/params.py hashed its local tensor): its placements say it is
            # replicated by the library's own account, so the odd copy is that rank's local tensor
            placements = params[live[0]][name].placements
            how = f" (a DTensor placed {', '.join(placements)}: its local tensor)" if placements else ""
            found.append(Finding("rank-divergence", f"{'layer ' + str(layer) + ' ' if layer is not None else ''}"
                                 f"parameter {name}", odd,
                                 detail=f"replicated parameter {name}{how} differs on "
                                        f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} (a stale or "
                                        f"wrong copy: every rank must hold the same values)",
                                 evidence={"placements": list(placements)} if placements else {}))
            break
    return found
