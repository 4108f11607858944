"""Hugging Face transformers' own tensor parallelism:
`PYTHONPATH=. tpprobe probe --model examples.hf_tp:build --nproc 2`.

A tiny random Llama is written with `save_pretrained` into a local folder (no model hub), then every
rank loads it the way transformers 5 documents: `AutoModelForCausalLM.from_pretrained(dir,
distributed_config=DistributedConfig(tp_size=N))`, the model's own `base_model_tp_plan` (colwise
q/k/v/gate/up, rowwise o_proj/down_proj: the rowwise `nn.Linear` calls `dist.all_reduce` itself).
`build_tp_plan_auto` loads it through the deprecated `tp_plan="auto"`. Nothing tells tpprobe where
the embedding or the layers are.

Faults, made with transformers' own plan vocabulary (`build_*` factories):
  build_local_rowwise  the plan entry `model.layers.*.mlp.down_proj` is changed from `rowwise` to
                       `local_rowwise`, a style registered in transformers' ParallelInterface as its
                       own RowwiseParallel with a Partial output ("the caller reduces"): nobody does
  build_swapped_plan   the plan entry `model.layers.*.mlp.down_proj` is `colwise` where `rowwise` belongs:
                       transformers shards it on the wrong dimension and the matmul refuses it in every
                       layer's down_proj (the first, layer 0, raises) on every rank; tpprobe names that module
  build_swapped_q_proj the plan entry `model.layers.*.self_attn.q_proj` is `rowwise` where `colwise` belongs (a
                       column-parallel projection in attention): refused in every layer's q_proj (layer 0 raises)
  build_stale_norm     layer FAULT_LAYER's `post_attention_layernorm.weight` differs on rank FAULT_RANK
  build_sequence_parallel_norms    the plan adds transformers' own `sequence_parallel` style on every norm (as
                       its fbgemm-fp8 plan does; healthy): the norms' weights become Replicate DTensors. It is the
                       only sequence-parallel piece transformers 5.19 registers: no style reduce-scatters a
                       row-parallel output or all-gathers a column-parallel input, and no model's plan uses it, so
                       the stream stays whole
  build_sequence_parallel_norms_stale  the same, layer FAULT_LAYER's `post_attention_layernorm.weight` (a
                       Replicate DTensor) differs on rank FAULT_RANK in its local tensor
Settings from the environment: TPLIBS_DTYPE (float32 | bfloat16), TPLIBS_LAYERS (4).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import torch

from tpprobe import ProbeTarget, RankContext

VOCAB, HIDDEN, HEADS, FFN, TOKENS = 96, 32, 4, 64, 8
FAULT_LAYER, FAULT_RANK = 2, 1


def _dtype() -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ.get("TPLIBS_DTYPE", "float32")]


def _layers() -> int:
    return int(os.environ.get("TPLIBS_LAYERS", "4"))


def save_tiny_llama(folder: str, n_layers: int, seed: int) -> str:
    """A random tiny LlamaForCausalLM saved with save_pretrained (what a user's checkpoint folder holds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=n_layers,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _shared_folder(ctx: RankContext, n_layers: int) -> str:
    """Rank 0 writes the checkpoint (transformers saves on rank 0 only), every rank reads it."""
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="tpprobe-hf-tiny-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    if ctx.rank == 0:
        save_tiny_llama(box[0], n_layers, ctx.seed)
    dist.barrier(group=ctx.group)
    return box[0]


def register_local_rowwise() -> None:
    """`local_rowwise`: transformers' own RowwiseParallel whose output stays Partial, for a caller that
    reduces itself (the style older transformers shipped under that name)."""
    from torch.distributed.tensor import Partial, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    ALL_PARALLEL_STYLES["local_rowwise"] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial())


def _build(ctx: RankContext, plan: dict | None = None, auto: bool = False, stale: bool = False) -> ProbeTarget:
    from transformers import AutoModelForCausalLM, DistributedConfig

    n_layers = _layers()
    import torch.distributed as dist

    folder = _shared_folder(ctx, n_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # tp_plan= is deprecated: that is the point of that factory
        if auto:
            model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=_dtype())
        else:
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=DistributedConfig(tp_size=ctx.world_size, tp_plan=plan), dtype=_dtype())
    dist.barrier(group=ctx.group)                   # every rank has read it
    if ctx.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    model.eval()
    if stale and ctx.rank == FAULT_RANK:
        w = model.model.layers[FAULT_LAYER].post_attention_layernorm.weight
        with torch.no_grad():
            (w.to_local() if hasattr(w, "to_local") else w).add_(1e-2)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(input_ids=ids.unsqueeze(0), use_cache=False).logits,
                       input_ids=ids, num_layers=n_layers, hidden_size=HIDDEN, dtype=_dtype(), arch="hf-llama")


def build(ctx: RankContext) -> ProbeTarget:
    return _build(ctx)


def build_tp_plan_auto(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, auto=True)


def build_local_rowwise(ctx: RankContext) -> ProbeTarget:
    register_local_rowwise()
    return _build(ctx, plan={"model.layers.*.mlp.down_proj": "local_rowwise"})


def build_swapped_plan(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, plan={"model.layers.*.mlp.down_proj": "colwise"})


def build_stale_norm(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, stale=True)


def build_swapped_q_proj(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, plan={"model.layers.*.self_attn.q_proj": "rowwise"})

# transformers' own `sequence_parallel` style on the norms (as its fbgemm-fp8 plan writes it): their weights
# become Replicate DTensors; the stream stays whole (no registered style reduce-scatters or all-gathers it)
SP_NORMS = {"model.layers.*.input_layernorm": "sequence_parallel",
            "model.layers.*.post_attention_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}


def build_sequence_parallel_norms(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, plan=SP_NORMS)


def build_sequence_parallel_norms_stale(ctx: RankContext) -> ProbeTarget:
    return _build(ctx, plan=SP_NORMS, stale=True)
