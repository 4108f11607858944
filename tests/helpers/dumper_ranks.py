"""Dumper folders written by SGLang's own dumper (`sglang.srt.debug_utils.dumper.dumper`) on real
gloo ranks, with SGLang's parallel state published over the world (so each file's meta carries
`sglang_parallel_info` with tp_rank / tp_size, exactly as under a server).

    run_ranks("tests.helpers.dumper_ranks:write", world=2, kwargs={"base": DIR, "exps": {...}})

`exps` maps an experiment name (the folder DIR/<name>) to a list of steps; each step is a list of
(name, kind, dims) records. The values are seeded and identical on every rank (the "full" tensor,
what tp=1 computes); `kind` says what this rank dumps of it:

  full        the full tensor (replicated: every rank equal, bitwise)
  ulp         the full tensor; on rank 1 every 7th element is moved by 1 ULP (bf16 rounding noise)
  scale       the full tensor in float32; on rank 1 token 3 is scaled by 1.01 (a 1 % error on one rank)
  embed       the full embedding lookup of the step's tokens (replicated)
  embed_part  the vocab-parallel embedding before its all-reduce: rows of tokens outside this
              rank's vocab shard are zero (Σ over ranks = embed)
  row_part    a row-parallel matmul's partial sum: x[:, shard] @ w[shard] (Σ over ranks = row_full)
  row_full    x @ w, the reduced value
  nan         the full tensor; on rank 1 token 2 holds a NaN and an Inf
  bump        the full tensor with token 3 scaled by 1.5 on every rank (wrong, but replicated)
  shard       this rank's slice of the last dim of the full tensor (what `h[tp]` declares)
  input_ids   the step's token ids

Step s of an experiment covers the tokens `split[s]` of one fixed token sequence (so two
experiments with different splits batch the same tokens differently).
"""
from __future__ import annotations

import os

import torch


def _full(seed: int, tokens: int, hidden: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype)


def _value(kind: str, name: str, ids: torch.Tensor, rows: slice, rank: int, tp: int, hidden: int,
           vocab: int, dtype, seed: int):
    n_all = int(ids.numel())
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g).to(dtype)
    x = torch.randn(n_all, hidden, generator=g).to(dtype)
    w = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(dtype)
    tid = ids[rows]
    if kind == "input_ids":
        return tid.clone()
    if kind == "embed":
        return emb[tid].clone()
    if kind == "embed_part":
        per = (vocab + tp - 1) // tp
        lo, hi = rank * per, min((rank + 1) * per, vocab)
        out = emb[tid].clone()
        out[(tid < lo) | (tid >= hi)] = 0
        return out
    if kind in ("row_part", "row_full"):
        xs = x[rows].float()
        if kind == "row_full":
            return (xs @ w.float()).to(dtype)
        per = hidden // tp
        sl = slice(rank * per, (rank + 1) * per)
        return (xs[:, sl] @ w.float()[sl]).to(dtype)
    full = _full(seed + sum(map(ord, name)), n_all, hidden, dtype)[rows].clone()
    if kind == "full":
        return full
    if kind == "ulp":
        if rank == 1:
            flat = full.view(-1)
            bits = flat.view(torch.int16)
            bits[::7] += 1                    # the next representable value: 1 ULP
        return full
    if kind == "scale":                       # float32: a 1 % error is far above rounding (in bf16 it is ~1 ULP)
        full = full.float()
        if rank == 1 and full.shape[0] > 3:
            full[3] *= 1.01
        return full
    if kind == "nan":                         # rank 1: token 2 overflowed
        if rank == 1 and full.shape[0] > 2:
            full[2, 0] = float("nan")
            full[2, 1] = float("inf")
        return full
    if kind == "bump":                        # every rank: token 3 is 1.5× (a material error, replicated)
        if full.shape[0] > 3:
            full[3] *= 1.5
        return full
    if kind == "shard":
        per = hidden // tp
        return full[:, rank * per:(rank + 1) * per].clone()
    raise ValueError(kind)


def write(ctx, base: str, exps: dict, tokens: int = 16, hidden: int = 32, vocab: int = 64,
          dtype: str = "bfloat16", seed: int = 0, seq: int = 64) -> dict:
    from tpprobe.engines.sglang.dist import publish_parallel_state
    publish_parallel_state(ctx.rank, ctx.world_size, ctx.local_rank, "gloo", "cpu")
    from sglang.srt.debug_utils.dumper import dumper

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed + 12345)
    ids = torch.randint(0, vocab, (seq,), generator=g)   # one token sequence; steps take slices of it
    for exp, steps in exps.items():
        dumper.reset()
        dumper.configure(enable=True, dir=base, exp_name=exp, enable_output_console=False)
        start = 0
        for step in steps:
            n = step["tokens"] if isinstance(step, dict) else tokens
            recs = step["records"] if isinstance(step, dict) else step
            rows = slice(start, start + n)
            for name, kind, dims in recs:
                v = _value(kind, name, ids, rows, ctx.rank, ctx.world_size, hidden, vocab, dt, seed)
                kw = {"dims": dims} if dims else {}
                dumper.dump(name, v, **kw)
            start += n
            dumper.step()
    dumper.configure(enable=False)
    return {"rank": ctx.rank, "files": sorted(os.listdir(base))}
