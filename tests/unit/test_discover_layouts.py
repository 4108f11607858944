"""Discovery from structure, for the shapes the TP libraries use (capture/discover.py, capture/hooks/):
layer containers (ModuleList, torchtitan's ModuleDict, Sequential) found by structure and accepted by
--layer-list; the embedding in any token layout ([b, s, h], Megatron's [s, b, h], [tokens, h]) read
back as [tokens, hidden] in the ids' order, the outermost consumer of the ids first and an inner match
when the outer one does not return rows; the model itself never the embedding. One process, no
collectives: the Tap's audit is off.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpprobe.capture.hooks import Tap
from tpprobe.core.errors import UsageError

V, H = 11, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return x + self.lin(x)


class Embed(nn.Module):
    """An embedding that returns its rows in `layout` for [b, s] ids."""

    def __init__(self, layout: str):
        super().__init__()
        self.table = nn.Embedding(V, H)
        self.layout = layout

    def forward(self, ids):
        h = self.table(ids)                       # [b, s, h]
        if self.layout == "sbh":
            return h.transpose(0, 1).contiguous()
        if self.layout == "th":
            return h.reshape(-1, H)
        if self.layout == "dict":                 # not rows: the inner table is the embedding
            return {"hidden": h}
        return h


class Model(nn.Module):
    def __init__(self, container: str = "list", layout: str = "bsh", n: int = 3):
        super().__init__()
        self.tok = Embed(layout)
        blocks = [Block() for _ in range(n)]
        self.layers = {"list": lambda: nn.ModuleList(blocks),
                       "dict": lambda: nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}),
                       "seq": lambda: nn.Sequential(*blocks)}[container]()
        self.head = nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, V))   # not a layer list

    def forward(self, ids):
        h = self.tok(ids)
        h = h["hidden"] if isinstance(h, dict) else h
        for layer in (self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers):
            h = layer(h)
        return self.head(h)


def _tap(model, ids, **kw):
    torch.manual_seed(0)
    with torch.no_grad(), Tap(model, input_ids=ids, audit=False, **kw) as tap:
        model(ids)
    return tap


IDS = torch.tensor([[1, 4, 2], [7, 0, 9]])       # [b=2, s=3]


@pytest.mark.parametrize("container", ["list", "dict", "seq"])
def test_layer_containers_are_found_by_structure_and_accepted_by_layer_list(container):
    model = Model(container, n=4).eval()
    for spec, how in ((None, "structure"), ("layers", "path")):
        tap = _tap(model, IDS, layers=spec)
        cov = tap.coverage()
        assert (cov["layer_list"], cov["layer_how"], cov["layers_found"], cov["layers_ran"]) == ("layers", how, 4, 4)
        assert tap.layer_indices == [0, 1, 2, 3] and cov["layer_names"] == [f"layers.{i}" for i in range(4)]
        assert cov["embed"] == "tok" and [n for n in tap.order if n.startswith("layer.")] == \
            [f"layer.{i}.out" for i in range(4)]


def test_a_sequential_of_unlike_modules_is_not_a_layer_list_and_layer_list_refuses_a_plain_module():
    model = Model("list", n=1).eval()          # head: Sequential(Linear, ReLU, Linear), 3 long; layers: 1
    assert _tap(model, IDS).coverage()["layer_list"] == "layers"
    with pytest.raises(UsageError, match=r"is a Linear, not a list of layers \(nn.ModuleList, nn.ModuleDict"):
        _tap(model, IDS, layers="layers.0.lin")


@pytest.mark.parametrize("layout", ["bsh", "sbh", "th"])
def test_the_embedding_is_found_in_every_token_layout_and_read_as_token_rows_in_ids_order(layout):
    model = Model("list", layout).eval()
    tap = _tap(model, IDS)
    assert tap.embed_name == "tok" and tap.embed_how == "structure" and tap.embed_layout == layout
    want = model.tok.table.weight[IDS.reshape(-1)]          # [b*s, h], b-major: the ids' order
    assert torch.equal(tap.captures["embed.out"], want)
    assert tap.captures["layer.0.out"].shape == (IDS.numel(), H)


def test_an_inner_module_is_the_embedding_when_the_outer_consumer_returns_no_rows():
    model = Model("list", "dict").eval()
    tap = _tap(model, IDS)
    assert tap.embed_name == "tok.table" and tap.embed_layout == "bsh"
    assert torch.equal(tap.captures["embed.out"], model.tok.table.weight[IDS.reshape(-1)])


def test_the_outermost_consumer_wins_over_the_inner_one_that_also_returns_rows():
    model = Model("list", "sbh").eval()                     # Megatron's LanguageModelEmbedding shape
    assert _tap(model, IDS).embed_name == "tok"


def test_the_model_itself_is_never_the_embedding():
    class Flat(nn.Module):                                   # no layer list, and it returns [b, s, h] itself
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(V, H))

        def forward(self, ids):
            return self.w[ids]

    tap = _tap(Flat().eval(), IDS)
    assert tap.embed_name is None and tap.coverage()["embed_how"] == "not found"
    tap = _tap(Model("list").eval(), IDS[0])                 # 1-D ids fed as they are: still the embedding
    assert tap.embed_name == "tok"


class _NoStorage(torch.Tensor):
    """A tensor subclass with no storage of its own (as a wrapper subclass is): its bytes cannot be read."""

    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} is not supported on this tensor")


def test_a_capture_point_tpprobe_cannot_read_is_named_and_the_others_are_kept():
    class Opaque(Block):
        def forward(self, x):
            return _NoStorage(x)

    model = Model("list", n=3).eval()
    model.layers[2] = Opaque()
    model.forward = lambda ids: model.layers[2](model.layers[1](model.layers[0](model.tok(ids))))
    tap = _tap(model, IDS)
    cov = tap.coverage()
    assert list(cov["unreadable_points"]) == ["layer.2.out"], cov["unreadable_points"]
    assert "_NoStorage" in cov["unreadable_points"]["layer.2.out"]
    assert {"embed.out", "layer.0.out", "layer.1.out"} <= set(tap.captures) and "layer.2.out" not in tap.captures
