"""The scoped hooks: what the Tap records on real gloo ranks, and that it always cleans up."""
import torch
import torch.distributed as dist

from tests.ranks import spawn
from tpprobe.capture.hooks import Tap
from tpprobe.model import BuiltinConfig, build_builtin
from tpprobe.target import RankContext


def _target(rank, world):
    ctx = RankContext(rank, world, rank, torch.device("cpu"), "gloo")
    return build_builtin(ctx, BuiltinConfig(num_layers=3, tokens=5))


def _audit(rank, world):
    t = _target(rank, world)
    with torch.no_grad(), Tap(t.model) as tap:
        t.forward()
        handles = [repr(h) for h in tap.handles[:2]]
    return {"records": [(a.where, a.source, a.group_size, a.shape) for a in tap.allreduces],
            "order": tap.order, "handles": handles, "unreduced": tap.unreduced_rows()}


def test_every_allreduce_is_attributed_to_its_layer_and_row_parallel_module():
    res = spawn(_audit, 2)[0]
    assert res["records"][0] == ("embed", None, 2, (5, 64))
    for k in range(3):
        assert res["records"][1 + 2 * k][:2] == (f"layer.{k}", f"layers.{k}.self_attn.o_proj")
        assert res["records"][2 + 2 * k][:2] == (f"layer.{k}", f"layers.{k}.mlp.down_proj")
    assert res["unreduced"] == []
    assert res["order"][:3] == ["embed.local", "embed.out", "layer.0.in_norm"]
    assert res["handles"] == ["<embed embed_tokens>", "<layer[0] layers.0>"]


def _raises(rank, world):
    t = _target(rank, world)
    orig = dist.all_reduce
    t.model.layers[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with torch.no_grad(), Tap(t.model):
            t.forward()
    except RuntimeError:
        pass
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in t.model.modules())
    return {"restored": dist.all_reduce is orig, "hooks_left": hooks_left}


def test_hooks_and_the_allreduce_wrapper_are_removed_when_the_forward_raises():
    res = spawn(_raises, 2)
    for r in res.values():
        assert r["restored"]
        assert r["hooks_left"] == 1          # only the test's own pre-hook remains
