"""Megatron-core's own GPTModel: `PYTHONPATH=. tpprobe probe --model examples.megatron_gpt:build --nproc 2`.

megatron-core 0.16.1's `GPTModel` with the local layer spec (`get_gpt_layer_local_spec()`: no
Transformer Engine), `parallel_state.initialize_model_parallel(tensor_model_parallel_size=N)` over
the probe's gloo group, CPU initialisation (`use_cpu_initialization=True`: every rank initialises
the full weights from one seed and keeps its shard). Its `LanguageModelEmbedding` returns
`[sequence, batch, hidden]` for `[batch, sequence]` ids and every layer keeps that layout; tpprobe
finds the embedding and `decoder.layers` from the structure and reads the stream in that layout.
The CPU workarounds Megatron's forward needs are in tpprobe/libs/megatron_cpu.py.

Faults, made Megatron's own way (`build_*` factories):
  build_explicit_comm  layer FAULT_LAYER's `mlp.linear_fc2` (a RowParallelLinear) has
                       `explicit_expert_comm` set: it skips its reduce, the caller is to
                       communicate, and nobody does
  build_input_not_parallel  layer FAULT_LAYER's `mlp.linear_fc2` (a RowParallelLinear) has
                       `input_is_parallel=False` where its input is already split: it splits it again and
                       its matmul refuses the shape on every rank; tpprobe names that module
  build_gather_qkv     layer FAULT_LAYER's `self_attention.linear_qkv` (a ColumnParallelLinear) has
                       `gather_output=True`: every rank gets all heads' q/k/v where its own belong, and the
                       attention refuses the shape when it splits them per head on every rank
  build_stale_norm     layer FAULT_LAYER's `pre_mlp_layernorm.weight` differs on rank FAULT_RANK
  build_stale_bias     layer FAULT_LAYER's `mlp.linear_fc2.bias` differs on rank FAULT_RANK: a RowParallelLinear's
                       bias is replicated (added after the reduce), so every rank must hold the same one
  build_sequence_parallel          the same model with `sequence_parallel=True` (healthy): the stream is
                       split over the ranks between layers ([s / tp, b, h]); tpprobe gathers each point
  build_sequence_parallel_scatter  with sequence parallelism, layer FAULT_LAYER's `mlp.linear_fc2` skips
                       its reduce-scatter (`explicit_expert_comm`) and keeps its own chunk of the partial
                       sum (Megatron's `scatter_to_sequence_parallel_region`: a scatter where the
                       reduce-scatter belongs)
Settings from the environment: TPLIBS_DTYPE (float32 | bfloat16), TPLIBS_LAYERS (4).
"""
from __future__ import annotations

import os

import torch

from tpprobe import ProbeTarget, RankContext
from tpprobe.libs import megatron_cpu

VOCAB, HIDDEN, HEADS, FFN, TOKENS = 96, 32, 4, 64, 8
FAULT_LAYER, FAULT_RANK = 2, 1


def _dtype() -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ.get("TPLIBS_DTYPE", "float32")]


def _layers() -> int:
    return int(os.environ.get("TPLIBS_LAYERS", "4"))


def gpt_model(tp: int, n_layers: int, dtype: torch.dtype, seed: int, sequence_parallel: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_cpu.init_model_parallel(tp)
    megatron_cpu.enable_rng()
    cfg = TransformerConfig(num_layers=n_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            ffn_hidden_size=FFN, tensor_model_parallel_size=tp, use_cpu_initialization=True,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0, sequence_parallel=sequence_parallel and tp > 1)
    torch.manual_seed(seed)                 # the same full weights on every rank before sharding
    with megatron_cpu.cpu_mode():
        model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=64, position_embedding_type="rope")
    return model.to(dtype).eval()


def _build(ctx: RankContext, explicit_comm: bool = False, stale: bool = False, sp: bool = False,
           scatter: bool = False, input_not_parallel: bool = False, stale_bias: bool = False,
           gather_qkv: bool = False) -> ProbeTarget:
    n_layers = _layers()
    model = gpt_model(ctx.world_size, n_layers, _dtype(), ctx.seed, sequence_parallel=sp)
    for p in model.parameters():
        p.requires_grad_(False)
    if explicit_comm:
        model.decoder.layers[FAULT_LAYER].mlp.linear_fc2.explicit_expert_comm = True   # "the caller reduces"
    if input_not_parallel:     # a wrong placement: the input is declared whole, so it is split again
        model.decoder.layers[FAULT_LAYER].mlp.linear_fc2.input_is_parallel = False
    if gather_qkv:             # a wrong placement in attention: the column-parallel qkv gathered whole
        model.decoder.layers[FAULT_LAYER].self_attention.linear_qkv.gather_output = True
    if scatter:
        # a scatter where the reduce-scatter belongs: the layer keeps its own chunk of the partial sum
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        fc2 = model.decoder.layers[FAULT_LAYER].mlp.linear_fc2
        fc2.explicit_expert_comm = True                # RowParallelLinear skips its reduce-scatter
        inner = fc2.forward

        def forward(x):
            out, bias = inner(x)
            return scatter_to_sequence_parallel_region(out), bias
        fc2.forward = forward
    if stale and ctx.rank == FAULT_RANK:
        with torch.no_grad():
            model.decoder.layers[FAULT_LAYER].pre_mlp_layernorm.weight.add_(1e-2)
    if stale_bias and ctx.rank == FAULT_RANK:
        with torch.no_grad():
            model.decoder.layers[FAULT_LAYER].mlp.linear_fc2.bias.add_(0.1)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    pos = torch.arange(TOKENS, device=ctx.device).unsqueeze(0)
    # Megatron's causal mask (True = masked), as its inference code passes it: without one the
    # softmax builds a default mask on "cuda"
    mask = torch.triu(torch.ones(TOKENS, TOKENS, dtype=torch.bool, device=ctx.device), diagonal=1)[None, None]

    def forward():
        with megatron_cpu.cpu_mode():
            return model(input_ids=ids.unsqueeze(0), position_ids=pos, attention_mask=mask)

    return ProbeTarget(model=model, forward=forward, input_ids=ids, num_layers=n_layers, hidden_size=HIDDEN,
                       dtype=_dtype(), arch="megatron-gpt")


def build(ctx: RankContext) -> ProbeTarget:
    return _build(ctx)


def build_explicit_comm(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, explicit_comm=True)


def build_input_not_parallel(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, input_not_parallel=True)


def build_stale_norm(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, stale=True)


def build_stale_bias(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, stale_bias=True)


def build_sequence_parallel(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, sp=True)


def build_sequence_parallel_scatter(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, sp=True, scatter=True)


def build_gather_qkv(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, gather_qkv=True)
