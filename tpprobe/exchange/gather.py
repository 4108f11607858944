"""The tensor exchange, once every rank posted healthy metadata.

`gather_full` is the simple, reference path (`--exchange full`): every capture of every rank is
gathered onto rank 0 over a dedicated gloo group. `exchange_fingerprint` (`--exchange
fingerprint`) moves a few KB per capture: the fingerprints travel with the metadata; only points
whose fingerprints disagree are broadcast from the reference rank, and each rank sends back its
own statistics. Every rank derives the same collective sequence from the posted metadata, so
the collectives always match.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..formats.capture_dir import LoadedRank
from ..capture.points import AR_IN, AR_OUT, SHARE, TOKENS, parse
from ..core.noise import dtype_from_str

# owned by the default process group it was made on: a new default group (destroy_process_group,
# then init again in one process) gets a new probe group on first use; reset() forgets it
_GROUP: dict = {}


def probe_group():
    """The probe's own gloo group (CPU tensors), apart from the model's collectives."""
    world = dist.group.WORLD
    if _GROUP.get("world") is not world:
        _GROUP.clear()
        _GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _GROUP["group"]


def reset() -> None:
    """Forget the probe's group (it is made again on the next probe_group)."""
    _GROUP.clear()


def post_meta(ch, tensors: dict, meta: dict, files: list) -> None:
    """This rank's metadata, its files and the index of its tensors, through the store (never a
    collective: a rank that died, hung or disagrees cannot hang this step)."""
    ch.post("meta", {"files": files, "status": meta["status"], "error": meta["error"],
                     "n_allreduce": len(meta["allreduces"]), "meta": meta,
                     "index": {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in tensors.items()}})


def gather_plan(posts: dict) -> list[tuple[str, list[int], str, bool]]:
    """[(name, shape, wire dtype, cast)] for tensors every rank holds with the same shape."""
    ranks = sorted(posts)
    idx = [posts[r]["index"] for r in ranks]
    plan = []
    for name in sorted(set(idx[0]).intersection(*idx[1:])):
        shapes = {tuple(i[name][0]) for i in idx}
        dtypes = {i[name][1] for i in idx}
        if len(shapes) != 1:
            continue
        cast = len(dtypes) != 1
        plan.append((name, list(shapes.pop()), "float64" if cast else dtypes.pop(), cast))
    return plan


def gather_full(ctx, tensors: dict, meta: dict, posts: dict) -> dict[int, LoadedRank]:
    group = probe_group()
    world = ctx.world_size
    records = {r: LoadedRank(r, posts[r]["meta"] if r != ctx.rank else meta, {}) for r in range(world)}
    for name, shape, wire, cast in gather_plan(posts):
        t = tensors[name].detach().to("cpu")
        t = (t.to(torch.float64) if cast else t).contiguous()
        bufs = [torch.empty(shape, dtype=dtype_from_str(wire)) for _ in range(world)] if ctx.rank == 0 else None
        dist.gather(t, gather_list=bufs, dst=0, group=group)
        if ctx.rank == 0:
            for r, b in enumerate(bufs):
                own = dtype_from_str(posts[r]["index"][name][1])
                records[r].tensors[name] = b.to(own) if cast else b
    return records if ctx.rank == 0 else {}


def detail_plan(posts: dict) -> list[tuple[str, list[int], str, bool]]:
    """Points whose fingerprints disagree across ranks and that every rank kept as a tensor: these
    get the detailed path. Everything else is settled by the fingerprints alone."""
    ranks = sorted(posts)
    plan = []
    for name, shape, wire, cast in gather_plan(posts):
        if parse(name).kind in (AR_IN, AR_OUT, TOKENS, SHARE):   # audits, tokens, own shares: never compared
            continue
        hashes = {posts[r]["meta"].get("fingerprints", {}).get(name, {}).get("bit_hash") for r in ranks}
        if len(hashes) > 1:
            plan.append((name, shape, wire, cast))
    return plan


def exchange_fingerprint(ctx, ch, tensors: dict, meta: dict, posts: dict, dtype) -> tuple[dict, dict, dict]:
    """The reference rank broadcasts its tensor for each disagreeing point, one at a time; every
    rank computes its own statistics against it and posts only those. Returns (records on rank 0,
    detail {name: {rank: stats}}, bytes moved by this rank)."""
    from ..core.noise import compare, judge_dtype

    group = probe_group()
    ref = min(posts)
    moved = {"sent": 0, "received": 0}
    mine = {}
    for name, shape, wire, cast in detail_plan(posts):
        t = tensors[name].detach().to("cpu")
        buf = (t.to(torch.float64) if cast else t).contiguous() if ctx.rank == ref else \
            torch.empty(shape, dtype=dtype_from_str(wire))
        dist.broadcast(buf, src=ref, group=group)
        nbytes = buf.numel() * buf.element_size()
        if ctx.rank == ref:
            moved["sent"] += nbytes * (ctx.world_size - 1)
        else:
            moved["received"] += nbytes
            base = buf.to(dtype_from_str(posts[ref]["index"][name][1])) if cast else buf
            mine[name] = compare(t, base, dtype=judge_dtype(t.dtype, base.dtype, dtype))
    ch.post("detail", mine)
    detail: dict = {}
    records = {}
    if ctx.rank == 0:
        got = ch.collect("detail", time.time() + 60)
        for r, stats in got.items():
            for name, s in stats.items():
                detail.setdefault(name, {})[r] = s
        records = {r: LoadedRank(r, posts[r]["meta"] if r != ctx.rank else meta,
                                 dict(tensors) if r == ctx.rank else {}) for r in range(ctx.world_size)}
    return records, detail, moved


def gather_records(ctx, out: Path, tensors: dict, meta: dict, posts: dict, all_ok: bool) -> dict:
    """Rank 0 gets every rank's record: collectives when every rank is healthy, else the files."""
    if ctx.world_size == 1:
        return {0: LoadedRank(0, meta, tensors)}
    if all_ok:
        return gather_full(ctx, tensors, meta, posts)
    if ctx.rank != 0:
        return {}
    from ..formats.capture_dir import load_rank_files
    from ..core.errors import TPProbeError
    # some rank is missing or failed: no collective is safe; read what the others wrote (on the
    # host: this rank's own tensors may still be on its GPU)
    records = {0: LoadedRank(0, meta, {k: v.cpu() for k, v in tensors.items()})}
    for r in posts:
        if r == 0:
            continue
        try:
            records[r] = load_rank_files(out, r, posts[r]["files"])
        except TPProbeError:
            pass   # checks report this rank from its posted metadata alone
    return records


def nbytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def bytes_post(rank: int, posts: dict, moved: dict) -> dict:
    """What this rank moved (metadata posts + tensors) and its peak memory, for the report."""
    import json
    import resource
    return {"sent": moved["sent"] + len(json.dumps(posts.get(rank, {}))),
            "received": moved["received"] + sum(len(json.dumps(p)) for r, p in posts.items() if r != rank),
            "tensor_sent": moved["sent"], "tensor_received": moved["received"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def full_gather_bytes(rank: int, world: int, posts: dict) -> dict:
    """Bytes the full gather moves: every rank but 0 sends its tensors, rank 0 receives them all."""
    sent = sum(nbytes(shape, wire) for _, shape, wire, _ in gather_plan(posts))
    return {"sent": sent, "received": 0} if rank else {"sent": 0, "received": sent * (world - 1)}


def exchange_records(ctx, ch, out: Path, tensors: dict, meta: dict, posts: dict, all_ok: bool,
                     fingerprints: bool, dtype) -> tuple[dict, dict, dict]:
    """(records on rank 0, fingerprint detail, bytes this rank moved): the fingerprint exchange when
    asked and every rank is healthy, else the full gather (or, with a rank missing, the files)."""
    if fingerprints:
        return exchange_fingerprint(ctx, ch, tensors, meta, posts, dtype)
    records = gather_records(ctx, out, tensors, meta, posts, all_ok)
    moved = full_gather_bytes(ctx.rank, ctx.world_size, posts) if all_ok and ctx.world_size > 1 \
        else {"sent": 0, "received": 0}
    return records, {}, moved


def exchange_summary(mode: str, ch, posts: dict, tensors: dict, deadline: float) -> dict:
    """The report's "exchange" part: the mode, bytes each rank moved, bytes captured, and which
    ranks' CUDA fingerprints took the torch path, or were combined on the host, and why."""
    out = {"mode": mode, "bytes_per_rank": ch.collect("bytes", deadline),
           "captured_bytes_per_rank": sum(t.numel() * t.element_size() for t in tensors.values())}
    for key in ("fingerprint_torch_path", "fingerprint_host_combine"):
        per_rank = {r: p["meta"][key] for r, p in posts.items() if p.get("meta", {}).get(key)}
        if per_rank:
            out[key] = per_rank
    return out
