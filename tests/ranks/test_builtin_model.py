"""The built-in TP model: every rank's sharded forward equals the unsharded tp=1 reference.

Start here to see what the CPU gloo mode's reference model guarantees: uneven vocab (131) at tp 2
and 4, out-of-shard rows masked, every residual stream equal to reference_streams().
"""
import pytest
import torch

from tests.helpers.ranks import spawn
from tpprobe.capture.hooks import Tap
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin, reference_streams
from tpprobe.core.target import RankContext

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def _forward(rank, world, dtype, seed):
    ctx = RankContext(rank, world, rank, torch.device("cpu"), "gloo")
    cfg = BuiltinConfig(num_layers=4, vocab=131, tokens=12, seed=seed, dtype=dtype, layer_ids=[-1, 1, 2])
    t = build_builtin(ctx, cfg)
    with torch.no_grad(), Tap(t.model) as tap:
        _, packed = t.forward()
    return {k: v for k, v in tap.captures.items()}, packed, t.model.embed_tokens.weight.shape[0]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_forward_equals_the_unsharded_reference(world, dtype):
    res = spawn(_forward, world, dtype, 3)
    ref = reference_streams(BuiltinConfig(num_layers=4, vocab=131, tokens=12, seed=3, dtype=torch.float32))
    for rank, (caps, packed, rows) in res.items():
        assert rows == -(-131 // world)                      # padded shard: ceil(131 / tp) rows
        for name, want in ref.items():
            torch.testing.assert_close(caps[name].float(), want, **TOL[dtype], msg=f"{name} rank {rank}")
        # the packed aux tensor is cat([embed, layer 1, layer 2]) on every rank
        want = torch.cat([ref["embed.out"], ref["layer.1.out"], ref["layer.2.out"]], -1)
        torch.testing.assert_close(packed.float(), want, **TOL[dtype])


def test_each_rank_embeds_only_its_vocab_shard_before_the_reduce():
    res = spawn(_forward, 2, torch.float32, 0)
    local0, local1 = res[0][0]["embed.local"], res[1][0]["embed.local"]
    nz0, nz1 = local0.ne(0).any(-1), local1.ne(0).any(-1)
    assert bool((nz0 ^ nz1).all()), "each token row must be non-zero on exactly one rank"
    torch.testing.assert_close(local0 + local1, res[0][0]["embed.out"])


def test_reference_config_rejects_heads_not_divisible_by_tp():
    from tpprobe.core.errors import UsageError
    with pytest.raises(UsageError, match=r"8 heads, not divisible by\s+3 ranks"):
        BuiltinConfig().validate(3)
