"""SGLang targets broken on purpose, for `tpprobe probe --model sglang_faults:FACTORY`.

`--inject` with `--engine sglang` makes the faults tpprobe knows on SGLang's own model (`tpprobe probe
--help` lists them); a fault of your own is a `--model` factory: build the tiny SGLang target
(tpprobe.engines.sglang.tiny.build_target, as `--engine sglang` does) and change it the way the real bug
does. Run from the repository root:

    PYTHONPATH=examples tpprobe probe --model sglang_faults:llama_skip_embed_reduce \\
        --num-layers 4 --tokens 7 --layers -1,0,2 --nproc 2

Each factory reads TPPROBE_FAULT_ARCH (llama | deepseek_v2, default llama) and uses the probe
defaults below (4 layers, 7 tokens, ids -1,0,2 for Llama / 0,1,3 for DeepSeek-V2, seed 0).
"""
from __future__ import annotations

import os

import torch

from tpprobe.core.target import ProbeTarget, RankContext

NUM_LAYERS, TOKENS, SEED = 4, 7, 0
IDS = {"llama": [-1, 0, 2], "deepseek_v2": [0, 1, 3]}


def _target(ctx: RankContext, arch: str | None = None) -> ProbeTarget:
    from tpprobe.engines.sglang.tiny import build_target

    arch = arch or os.environ.get("TPPROBE_FAULT_ARCH", "llama")
    return build_target(ctx, arch=arch, num_layers=NUM_LAYERS, tokens=TOKENS, seed=SEED,
                        dtype=torch.float32, layer_ids=IDS[arch])


def healthy(ctx: RankContext) -> ProbeTarget:
    """The same tiny SGLang target, unchanged (the control run)."""
    return _target(ctx)


def skip_embed_reduce(embedding) -> None:
    """Make SGLang's VocabParallelEmbedding skip its all-reduce exactly as SGLang's own code path
    does under DP attention with scattered attention input: its forward sees
    `get_attn_tp_context().input_scattered` (the `attn_input_scattered` forward flag that
    `AttnTpContext.maybe_input_scattered` sets) and returns each rank's partial embedding. The
    flag is scoped to the embedding call only, so the layers run their normal (gathered) path:
    that mismatch (the embedding believes the input is scattered, the layers do not) is the bug."""
    from sglang.srt.runtime_context import get_forward

    orig = embedding.forward

    def forward(input_, _orig=orig):
        with get_forward().scoped(attn_input_scattered=True):
            return _orig(input_)

    embedding.forward = forward


def llama_skip_embed_reduce(ctx: RankContext) -> ProbeTarget:
    t = _target(ctx)
    skip_embed_reduce(t.model.model.embed_tokens)
    return t
