"""The store protocol never reads a post as missing because the post landed between two reads
(`rank 0 did not say where to write the capture` on a healthy run under load).

Each test drives the real protocol functions over a real torch.distributed store (HashStore),
with the interleaving that lost the post forced: the reader's first read finds nothing, and the
writer's posts land right after it, before the reader's second check."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch.distributed as dist

from tpprobe.exchange.dist import Channel, agree_out_dir


class LateChannel(Channel):
    """Rank 1's channel: the first read of `key` finds nothing, and then `land()` posts (as a
    descheduled reader would see it)."""

    def __init__(self, store, rank, world, key, land):
        super().__init__(store, rank, world)
        self.key, self.land, self.armed = key, land, True

    def get(self, key, rank):
        v = super().get(key, rank)
        if self.armed and key == self.key:
            self.armed = False
            self.land()
        return v


def test_rank_0s_folder_posted_between_a_peers_two_reads_is_still_read(tmp_path):
    store = dist.HashStore()
    rank0 = Channel(store, 0, 2)
    out = str(tmp_path / "run")

    def land():            # rank 0 posts "out", then (its build done) "ready"
        rank0.post("out", {"out": out})
        rank0.post("ready", {"ok": True})
    ch = LateChannel(store, 1, 2, "out", land)
    got, created = agree_out_dir(SimpleNamespace(out=None, timeout=5.0), SimpleNamespace(rank=1), ch)
    assert (got, created) == (out, False)


def test_a_post_that_lands_while_the_wait_decides_to_stop_early_is_collected():
    store = dist.HashStore()
    poster = Channel(store, 1, 2)
    Channel(store, 0, 2).post("meta", {"status": "ok"})
    calls = []

    def stop_early(found):       # e.g. "rank 1's heartbeat is old": decided after the posts were read
        calls.append(dict(found))
        poster.post("meta", {"status": "ok"})
        return True
    found = Channel(store, 0, 2).collect("meta", time.time() + 5, stop_early=stop_early)
    assert sorted(found) == [0, 1]
    assert sorted(calls[0]) == [0]      # it had decided with rank 1 still missing


def test_a_post_made_just_before_the_deadline_is_read():
    store = dist.HashStore()
    poster = Channel(store, 0, 2)

    class Slow(Channel):
        def get(self, key, rank):
            v = super().get(key, rank)
            if v is None:              # the read misses it, the post lands, and the deadline passes
                poster.post("final", {"code": 0}, rank=0)
                time.sleep(0.06)
            return v
    assert Slow(store, 1, 2).collect_rank("final", 0, time.time() + 0.05) == {"code": 0}
