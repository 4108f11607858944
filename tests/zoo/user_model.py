"""Factories for tests/ranks/test_run_folders.py: docs/tp-libraries.md's "Probe your own model" snippet as a user
writes it (no `arch`, so nothing of the built-in model's reference may apply), and a factory that raises."""
from __future__ import annotations

import torch

from examples.my_model import FFN, HIDDEN, LAYERS, TOKENS, VOCAB, TinyTPModel  # noqa: F401
from tpprobe import ProbeTarget, RankContext


def readme_snippet(ctx: RankContext) -> ProbeTarget:
    model = TinyTPModel(ctx, seed=ctx.seed).to(ctx.device)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    return ProbeTarget(model=model, forward=lambda: model(ids), input_ids=ids,
                       num_layers=LAYERS, hidden_size=HIDDEN, dtype=torch.float32)


def raises(ctx: RankContext) -> ProbeTarget:
    raise RuntimeError("the factory's own bug")
