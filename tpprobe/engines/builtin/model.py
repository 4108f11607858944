"""The built-in TP model: tpprobe's reference model for the CPU gloo mode.

Shaped like SGLang's Llama / DeepSeek-V2 code so that what the probe learns on it transfers:
a VocabParallelEmbedding (vocab sharded with padding, out-of-shard ids masked to zero rows, then
all-reduce), decoder layers with column-parallel QKV / gate-up and row-parallel o_proj /
down_proj whose outputs are all-reduced, fused add+RMSNorm with the (hidden_states, residual)
convention, and SGLang-Llama's EAGLE-3 capture (id k captures the residual stream entering layer
k+1, i.e. leaving layer k; id -1 is the embedding output).

Every rank builds the same full weights from one seed and keeps its shard, so the unsharded
tp=1 forward (`reference_streams`) exists on every rank for checking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...capture.points import EMBED_OUT, layer_out
from ...core.errors import UsageError
from ...config.options import BUILTIN
from ...core.target import ProbeTarget, RankContext


@dataclass
class BuiltinConfig:
    # the defaults are the probe's (tpprobe/config/options.py BUILTIN, declared once there)
    num_layers: int = BUILTIN["num_layers"]
    hidden: int = BUILTIN["hidden"]
    heads: int = BUILTIN["heads"]
    ffn: int = BUILTIN["ffn"]
    vocab: int = BUILTIN["vocab"]
    tokens: int = BUILTIN["tokens"]
    seed: int = BUILTIN["seed"]
    # the embedding rows' standard deviation: 1.0 by default (the probe's noise calibration was
    # measured there); trained Llama/DeepSeek embeddings are of order 0.01, so a capture taken after
    # the first norm (F13) rescales the embedding slot ~100x, as `--embed-std 0.01` shows
    embed_std: float = BUILTIN["embed_std"]
    dtype: torch.dtype = torch.float32
    layer_ids: list[int] = field(default_factory=lambda: list(BUILTIN["layer_ids"]))
    # how row-parallel outputs are reduced: "default" (the backend's all-reduce) or "ordered" (TP-
    # and batch-invariant: see ordered_all_reduce); switch_bytes (ordered only) sends messages
    # larger than it through the backend's all-reduce instead: a size-dependent path, to be found
    reduce: str = "default"
    switch_bytes: Optional[int] = None

    @classmethod
    def from_options(cls, opts, layer_ids: Optional[list[int]] = None) -> "BuiltinConfig":
        """The built-in model `tpprobe probe` builds from its options (ProbeOptions)."""
        return cls(num_layers=opts.num_layers, hidden=opts.hidden, heads=opts.heads, ffn=opts.ffn,
                   vocab=opts.vocab, tokens=opts.tokens, seed=opts.seed, dtype=opts.torch_dtype,
                   embed_std=opts.embed_std,
                   **({"layer_ids": layer_ids} if layer_ids is not None else {}))

    def validate(self, world_size: int) -> None:
        if self.num_layers < 1:
            raise UsageError(f"--num-layers must be >= 1 (got {self.num_layers})")
        if self.tokens < 1:
            raise UsageError(f"--tokens must be >= 1 (got {self.tokens})")
        if not self.embed_std > 0 or math.isinf(self.embed_std):
            raise UsageError(f"--embed-std must be a positive number (got {self.embed_std})")
        if self.hidden < 8 or self.hidden % self.heads:
            raise UsageError(f"--hidden ({self.hidden}) must be >= 8 and a multiple of the head "
                             f"count ({self.heads})")
        if self.heads % world_size:
            raise UsageError(f"the built-in model has {self.heads} heads, not divisible by {world_size} ranks: "
                             f"use a TP size dividing {self.heads} (probe's --nproc, invariance's --tp), "
                             f"or other --heads")
        if self.ffn % world_size:
            raise UsageError(f"--ffn ({self.ffn}) must be divisible by the {world_size} ranks")
        if self.vocab < world_size:
            raise UsageError(f"--vocab ({self.vocab}) is smaller than the {world_size} ranks: "
                             f"every rank needs at least one vocab row")
        if self.reduce not in ("default", "ordered"):
            raise UsageError(f"unknown --reduce {self.reduce!r}: use default or ordered")
        if self.reduce == "ordered" and (LEAVES % world_size or self.hidden % LEAVES or self.ffn % LEAVES):
            raise UsageError(f"--reduce ordered sums {LEAVES} fixed slices of every row-parallel contraction: "
                             f"tp ({world_size}) must divide {LEAVES}, and --hidden ({self.hidden}) and --ffn "
                             f"({self.ffn}) must be multiples of {LEAVES}")
        if self.switch_bytes is not None and (self.reduce != "ordered" or self.switch_bytes < 0):
            raise UsageError("a switch size needs --reduce ordered and a byte count >= 0")


def all_reduce(x: torch.Tensor, ctx: RankContext, mode: str = "default",
               switch_bytes: Optional[int] = None) -> torch.Tensor:
    """The TP all-reduce every row-parallel output goes through (in place, like SGLang's)."""
    if ctx.world_size == 1:   # tp=1 (the reference forward): nothing to reduce
        return x
    if mode == "ordered" and (switch_bytes is None or x.numel() * x.element_size() <= switch_bytes):
        return ordered_all_reduce(x, ctx)
    dist.all_reduce(x, group=ctx.group)
    return x


# ---- the ordered (TP- and batch-invariant) reduction ------------------------------------------
# Every row-parallel contraction (o_proj, down_proj) is cut into LEAVES fixed slices of its input
# dimension; each slice's product is computed one token row at a time, and the slices are summed
# by ONE binary tree. A rank at tp holds LEAVES/tp consecutive slices, a whole subtree: it sums its
# subtree, and the all-reduce (all-gather + the tree's top levels in rank order) finishes the same
# tree. So tp 1, 2, 4 and 8 add the same numbers in the same order, whatever the batch.
LEAVES = 8


def tree_sum(parts: list) -> torch.Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: pairwise, left to right (len(parts) a power of two)."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear one token row at a time: a row's result never depends on the rows batched with it."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return F.linear(x, w)
    return torch.cat([F.linear(rows[i:i + 1], w) for i in range(rows.shape[0])]).view(*x.shape[:-1], w.shape[0])


def ordered_all_reduce(x: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """All-gather every rank's partial, then sum them by a binary tree in rank order (in place)."""
    parts = torch.empty((ctx.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
    gather(parts, x.contiguous(), group=ctx.group)
    return x.copy_(tree_sum(list(parts.view(ctx.world_size, *x.shape).unbind(0))))


def _shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    per = math.ceil(n / world)
    return min(rank * per, n), min((rank + 1) * per, n)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full_weight: torch.Tensor, ctx: RankContext, dtype: torch.dtype):
        super().__init__()
        vocab, hidden = full_weight.shape
        self.ctx = ctx
        per = math.ceil(vocab / ctx.world_size)
        self.org_vocab_start_index, self.org_vocab_end_index = _shard_range(vocab, ctx.rank, ctx.world_size)
        shard = torch.zeros(per, hidden)  # padded rows stay zero
        n = self.org_vocab_end_index - self.org_vocab_start_index
        shard[:n] = full_weight[self.org_vocab_start_index:self.org_vocab_end_index]
        self.weight = nn.Parameter(shard.to(dtype), requires_grad=False)
        self.skip_reduce = False  # fault hook (F1): the all-reduce is skipped, as SGLang does under DP attention
        self.reduce_mode, self.switch_bytes = "default", None     # TPModel sets them from the config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids >= self.org_vocab_start_index) & (ids < self.org_vocab_end_index)
        local_ids = torch.where(mask, ids - self.org_vocab_start_index, torch.zeros_like(ids))
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(~mask.unsqueeze(-1), 0)
        if self.skip_reduce:
            return out
        return all_reduce(out, self.ctx, self.reduce_mode, self.switch_bytes)


class RMSNorm(nn.Module):
    """SGLang's convention: forward(x) -> norm(x); forward(x, residual) -> (norm(x+res), x+res)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ColumnParallelLinear(nn.Module):
    def __init__(self, full_weight: torch.Tensor, ctx: RankContext, dtype: torch.dtype, chunks: int = 1):
        super().__init__()
        # full_weight [out, in]; each of `chunks` stacked blocks (q|k|v, gate|up) is split by rank
        parts = [p.chunk(ctx.world_size, 0)[ctx.rank] for p in full_weight.chunk(chunks, 0)]
        self.weight = nn.Parameter(torch.cat(parts, 0).to(dtype).contiguous(), requires_grad=False)
        self.reduce_mode = "default"

    def forward(self, x):
        return rowwise_linear(x, self.weight) if self.reduce_mode == "ordered" else F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Row-split linear; like SGLang's with reduce_results=True it reduces its own output."""

    def __init__(self, full_weight: torch.Tensor, ctx: RankContext, dtype: torch.dtype):
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(full_weight.chunk(ctx.world_size, 1)[ctx.rank].to(dtype).contiguous(),
                                   requires_grad=False)
        self.reduce_results = True
        self.reduce_mode, self.switch_bytes = "default", None

    def forward(self, x):
        if self.reduce_mode == "ordered":   # this rank's subtree of the LEAVES slices
            n = LEAVES // self.ctx.world_size
            out = tree_sum([rowwise_linear(xs, ws) for xs, ws in zip(x.chunk(n, -1), self.weight.chunk(n, 1))])
        else:
            out = F.linear(x, self.weight)
        if self.reduce_results:
            out = all_reduce(out, self.ctx, self.reduce_mode, self.switch_bytes)
        return out


class Attention(nn.Module):
    def __init__(self, w: dict, ctx: RankContext, cfg: BuiltinConfig):
        super().__init__()
        self.local_heads = cfg.heads // ctx.world_size
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv_proj = ColumnParallelLinear(w["qkv"], ctx, cfg.dtype, chunks=3)
        self.o_proj = RowParallelLinear(w["o"], ctx, cfg.dtype)

    def forward(self, x, seq_lens=None):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, -1)
        q, k, v = (y.view(t, self.local_heads, self.head_dim).transpose(0, 1) for y in (q, k, v))
        if seq_lens is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # a packed batch: each sequence attends to itself only
            ends = torch.tensor(seq_lens).cumsum(0).tolist()
            o = torch.cat([F.scaled_dot_product_attention(q[:, e - n:e], k[:, e - n:e], v[:, e - n:e], is_causal=True)
                           for n, e in zip(seq_lens, ends)], dim=1)
        return self.o_proj(o.transpose(0, 1).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, w: dict, ctx: RankContext, cfg: BuiltinConfig):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(w["gate_up"], ctx, cfg.dtype, chunks=2)
        self.down_proj = RowParallelLinear(w["down"], ctx, cfg.dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class TPDecoderLayer(nn.Module):
    def __init__(self, w: dict, ctx: RankContext, cfg: BuiltinConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(w["ln1"], cfg.dtype)
        self.self_attn = Attention(w, ctx, cfg)
        self.post_attention_layernorm = RMSNorm(w["ln2"], cfg.dtype)
        self.mlp = MLP(w, ctx, cfg)

    def forward(self, hidden_states, residual, seq_lens=None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, seq_lens)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class TPModel(nn.Module):
    """embed_tokens -> layers -> norm, with SGLang-Llama-style EAGLE-3 aux capture."""

    def __init__(self, weights: dict, ctx: RankContext, cfg: BuiltinConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(weights["embed"], ctx, cfg.dtype)
        self.layers = nn.ModuleList(TPDecoderLayer(w, ctx, cfg) for w in weights["layers"])
        self.norm = RMSNorm(weights["norm"], cfg.dtype)
        self.layers_to_capture: list[int] = []
        # Fault switches (tpprobe.engines.builtin.faults sets them; all off in a healthy model).
        self.capture_fn = None          # how one aux capture is taken (default: clone of h + r)
        self.pack_fn = None             # how the captures are packed (default: cat(dim=-1))
        for m in self.modules():        # the reduction every sharded module uses (cfg.reduce)
            if hasattr(m, "reduce_mode"):
                m.reduce_mode = cfg.reduce
                if hasattr(m, "switch_bytes"):
                    m.switch_bytes = cfg.switch_bytes

    def set_eagle3_layers_to_capture(self, layer_ids: list[int]) -> None:
        # SGLang llama.py: layer id k captures the stream entering layer k+1 (so -1 = embedding)
        self.layers_to_capture = [i + 1 for i in layer_ids]

    def forward(self, ids: torch.Tensor, seq_lens: Optional[list[int]] = None):
        """ids: one sequence [tokens], or several packed [sum(seq_lens)] with their lengths."""
        hidden_states = self.embed_tokens(ids)
        residual = None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(self._capture(i, hidden_states, residual))
            hidden_states, residual = (layer(hidden_states, residual) if seq_lens is None else
                                       layer(hidden_states, residual, seq_lens=seq_lens))
        # An id of L-1 maps to L, which this loop never reaches: silently dropped (as in SGLang).
        out, _ = self.norm(hidden_states, residual)
        packed = (self.pack_fn or _pack)(aux) if aux else None
        return out, packed

    def _capture(self, i, hidden_states, residual):
        if self.capture_fn is not None:
            return self.capture_fn(i, hidden_states, residual)
        return hidden_states.clone() if residual is None else hidden_states + residual


def _pack(aux: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(aux, dim=-1)


def full_weights(cfg: BuiltinConfig) -> dict:
    """Every full (unsharded) weight from one seed, float32 on CPU, in a fixed order."""
    g = torch.Generator().manual_seed(cfg.seed)
    h, f = cfg.hidden, cfg.ffn

    def rnd(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    layers = []
    for _ in range(cfg.num_layers):
        layers.append({
            "ln1": 1 + rnd(h, scale=0.1), "ln2": 1 + rnd(h, scale=0.1),
            "qkv": rnd(3 * h, h, scale=h ** -0.5), "o": rnd(h, h, scale=h ** -0.5),
            "gate_up": rnd(2 * f, h, scale=h ** -0.5), "down": rnd(h, f, scale=f ** -0.5),
        })
    return {"embed": rnd(cfg.vocab, h, scale=cfg.embed_std), "layers": layers, "norm": 1 + rnd(h, scale=0.1)}


def input_ids(cfg: BuiltinConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, cfg.vocab, (cfg.tokens,), generator=g)


def reference_streams(cfg: BuiltinConfig, weights: dict | None = None, dtype=None) -> dict[str, torch.Tensor]:
    """The unsharded tp=1 forward: {"embed.out": ..., "layer.k.out": ...} (residual streams)."""
    ctx1 = RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    c = BuiltinConfig(**{**cfg.__dict__, "dtype": dtype or cfg.dtype})
    model = TPModel(weights or full_weights(c), ctx1, c)
    ids = input_ids(c)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        h = model.embed_tokens(ids)
        out[EMBED_OUT] = h.clone()
        r = None
        for k, layer in enumerate(model.layers):
            h, r = layer(h, r)
            out[layer_out(k)] = h + r
    return out


def build_builtin(ctx: RankContext, cfg: BuiltinConfig) -> ProbeTarget:
    cfg.validate(ctx.world_size)
    model = TPModel(full_weights(cfg), ctx, cfg).to(ctx.device).eval()
    ids = input_ids(cfg).to(ctx.device)
    model.set_eagle3_layers_to_capture(cfg.layer_ids)
    return ProbeTarget(
        model=model, forward=lambda: model(ids), input_ids=ids, num_layers=cfg.num_layers,
        hidden_size=cfg.hidden, dtype=cfg.dtype, arch="builtin",
        packed_aux=lambda result: result[1], model_layer_ids=list(cfg.layer_ids),
        info={"vocab": cfg.vocab, "heads": cfg.heads, "ffn": cfg.ffn, "seed": cfg.seed,
              **({"reduce": cfg.reduce} if cfg.reduce != "default" else {}),
              **({"embed_std": cfg.embed_std} if cfg.embed_std != BUILTIN["embed_std"] else {}),
              **({"switch_bytes": cfg.switch_bytes} if cfg.switch_bytes is not None else {})},
        forward_batch=lambda seqs: model(torch.cat([s.to(ctx.device) for s in seqs]),
                                         seq_lens=[int(s.numel()) for s in seqs]),
    )

