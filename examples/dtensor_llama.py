"""PyTorch's own tensor parallelism (DTensor), the torchtitan way:
`PYTHONPATH=. tpprobe probe --model examples.dtensor_llama:build --nproc 2`.

A small Llama written like torchtitan's (`tok_embeddings`, layers in an `nn.ModuleDict`, `norm`,
`output`), parallelized with torch's own `parallelize_module` and `ColwiseParallel` /
`RowwiseParallel` over a `DeviceMesh` made from the probe's process group. Nothing here tells
tpprobe where the embedding or the layers are: it finds them from the structure, audits the reduces
DTensor issues when a `Partial` output is redistributed (functional collectives), and hashes the
replicated parameters through their local tensors.

Faults, each made the library's own way (`build_*` factories):
  build_partial      layer FAULT_LAYER's `feed_forward.w2` is `RowwiseParallel(output_layouts=Partial(),
                     use_local_output=True)`: the plan says the caller reduces, and nobody does
  build_colwise_w2   layer FAULT_LAYER's `feed_forward.w2` is `ColwiseParallel()` where `RowwiseParallel()`
                     belongs (a plan entry swapped): DTensor itself refuses it, with a shape error in that
                     module's matmul on every rank; tpprobe names that module
  build_rowwise_wq   layer FAULT_LAYER's `attention.wq` is `RowwiseParallel()` where `ColwiseParallel()` belongs
                     (a column-parallel projection in attention swapped): refused the same way, in that wq
  build_stale_norm   layer FAULT_LAYER's `ffn_norm.weight` differs on rank FAULT_RANK (a stale copy)
  build_sequence_parallel  torchtitan's plan with sequence parallelism (healthy): `SequenceParallel()` norms
                     (their weights `Replicate` DTensors), `PrepareModuleInput` all-gathers before attention
                     and the feed-forward, `RowwiseParallel(output_layouts=Shard(1))` reduce-scatters; between
                     the layers each rank holds its chunk `[b, s / tp, h]`, which tpprobe gathers to check
  build_sequence_parallel_stale_norm  the same, layer FAULT_LAYER's `ffn_norm.weight` (a Replicate DTensor)
                     differs on rank FAULT_RANK in its local tensor: each rank normalises its own chunk, so the
                     gathered stream is alike on every rank and only the parameter's hash shows it
  build_sequence_parallel_scatter  the same, layer FAULT_LAYER's `w2` is `RowwiseParallel(output_layouts=
                     Partial(), use_local_output=True)` and its `feed_forward` declares that output
                     `Replicate` (`PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=
                     Shard(1))`): a local slice where the reduce-scatter belongs, each rank keeps its chunk of
                     the partial sum
Settings from the environment: TPLIBS_DTYPE (float32 | bfloat16), TPLIBS_LAYERS (4).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, HEADS, FFN, TOKENS = 96, 32, 4, 64, 8
FAULT_LAYER, FAULT_RANK = 2, 1


def _dtype() -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ.get("TPLIBS_DTYPE", "float32")]


def _layers() -> int:
    return int(os.environ.get("TPLIBS_LAYERS", "4"))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them at tp 1), as torchtitan's attention reads them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(HIDDEN)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(HIDDEN)
        self.feed_forward = FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, n_layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(n_layers)})   # torchtitan's container
        self.norm = nn.RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, mesh, partial_layer: int | None = None,
                colwise_layer: int | None = None, rowwise_wq_layer: int | None = None) -> Transformer:
    """torchtitan's plan for a Llama: vocab-parallel embedding, column-parallel q/k/v and w1/w3,
    row-parallel wo and w2, a column-parallel output gathered to every rank."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for name, block in model.layers.items():
        w2 = (RowwiseParallel(output_layouts=Partial(), use_local_output=True)     # "the caller reduces"
              if partial_layer is not None and int(name) == partial_layer else
              ColwiseParallel() if colwise_layer is not None and int(name) == colwise_layer  # the wrong style
              else RowwiseParallel())
        parallelize_module(block, mesh, {
            "attention.wq": (RowwiseParallel() if rowwise_wq_layer is not None and int(name) == rowwise_wq_layer
                             else ColwiseParallel()),                      # the wrong style, in attention
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": w2,
        })
    return model


def parallelize_sequence_parallel(model: Transformer, mesh, scatter_layer: int | None = None) -> Transformer:
    """torchtitan's plan with sequence parallelism: between the layers' row-parallel outputs and the next
    norm each rank holds its chunk of the sequence (`Shard(1)`: `[b, s / tp, h]`). The norms are
    `SequenceParallel()` (their weights become `Replicate` DTensors, each rank normalising its chunk),
    `PrepareModuleInput` all-gathers the chunks before attention and the feed-forward, the row-parallel
    `wo` / `w2` reduce-scatter (`RowwiseParallel(output_layouts=Shard(1))`), the embedding too.

    scatter_layer: that layer's `w2` is `RowwiseParallel(output_layouts=Partial(), use_local_output=True)`
    ("the caller reduce-scatters") and its `feed_forward` declares that output `Replicate` and takes
    this rank's chunk (`PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))`:
    a local slice, no collective): the reduce-scatter is skipped, each rank keeps its chunk of the
    partial sum."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for name, block in model.layers.items():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        if scatter_layer is not None and int(name) == scatter_layer:
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Partial(), use_local_output=True)
            plan["feed_forward_out"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        out_style = plan.pop("feed_forward_out", None)
        parallelize_module(block, mesh, plan)
        if out_style is not None:        # a second style on the same module: applied after its input's
            parallelize_module(block.feed_forward, mesh, out_style)
    return model


def _build(ctx: RankContext, partial_layer: int | None = None, stale: bool = False,
           colwise_layer: int | None = None, sp: bool = False, scatter_layer: int | None = None,
           rowwise_wq_layer: int | None = None) -> ProbeTarget:
    from torch.distributed.device_mesh import DeviceMesh

    import torch.distributed as dist
    n_layers = _layers()
    torch.manual_seed(ctx.seed)                 # the same full weights on every rank before sharding
    model = Transformer(n_layers).to(device=ctx.device, dtype=_dtype()).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mesh = DeviceMesh.from_group(ctx.group or dist.group.WORLD, ctx.device.type)
    if sp:
        parallelize_sequence_parallel(model, mesh, scatter_layer)
    else:
        parallelize(model, mesh, partial_layer, colwise_layer, rowwise_wq_layer)
    if stale and ctx.rank == FAULT_RANK:
        w = model.layers[str(FAULT_LAYER)].ffn_norm.weight
        with torch.no_grad():
            (w.to_local() if hasattr(w, "to_local") else w).add_(1e-2)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids.unsqueeze(0)), input_ids=ids, num_layers=n_layers,
                       hidden_size=HIDDEN, dtype=_dtype(), arch="dtensor-llama")


def build(ctx: RankContext) -> ProbeTarget:
    return _build(ctx)


def build_partial(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, partial_layer=FAULT_LAYER)


def build_stale_norm(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, stale=True)


def build_colwise_w2(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, colwise_layer=FAULT_LAYER)


def build_sequence_parallel(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, sp=True)


def build_sequence_parallel_stale_norm(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, sp=True, stale=True)


def build_sequence_parallel_scatter(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, sp=True, scatter_layer=FAULT_LAYER)


def build_rowwise_wq(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, rowwise_wq_layer=FAULT_LAYER)
