"""A hand-built EAGLE-3 draft whose prediction needs every slot it was built on, in its order.

`hand_draft(streams, trained, out, ids)` writes a single-layer `LlamaForCausalLMEagle3` checkpoint (as
SpecForge writes one: config.json + model.safetensors) that reads the target streams `trained` (HF
hidden_states indices, one per slot): its `fc` maps each slot through its own random orthogonal
block and sums them, its mid layer adds nothing (o_proj and down_proj are zero, so the residual
passes), and its `lm_head` is solved in closed form so that on exactly those streams the top-1 at
position t is token t+2 of the sequence. Any other stream in any slot (or the same streams in
another order) leaves the sum unrelated to the solved directions: acceptance near chance.

`planted_streams(L, ...)` is a target's streams for one token sequence: the embedding and every
layer's output, random and distinct per layer, as a capture of a model of L layers would hold them.
"""
from __future__ import annotations

from pathlib import Path

import torch


def planted_streams(num_layers: int, hidden: int = 64, tokens: int = 48, vocab: int = 16, seed: int = 0):
    from tpprobe.eagle3.fix import streams_from_tensors
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    by = {h: torch.randn(tokens, hidden, generator=g) for h in range(num_layers + 1)}
    return streams_from_tensors(ids, by, num_layers, f"planted target of {num_layers} layers")


def config(hidden: int, vocab: int, ids) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 8, "num_key_value_heads": 4,
            "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
            "target_hidden_size": hidden, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}


def hand_draft(streams, trained: list[int], out, ids: list[int], vocab: int = 16, seed: int = 1) -> Path:
    from tpprobe.eagle3.accept.draft import write_draft
    g = torch.Generator().manual_seed(seed)
    H, k = streams.hidden, len(trained)
    blocks = [torch.linalg.qr(torch.randn(H, H, generator=g))[0] for _ in range(k)]
    fc = torch.cat(blocks, dim=1)                               # h = sum_s Q_s x_s
    x = streams.packed(trained) @ fc.t()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # the final norm (weight 1)
    T = streams.input_ids.numel()
    y = torch.nn.functional.one_hot(streams.input_ids[2:], vocab).float() * 10.0     # token t+2 at row t
    lm = torch.linalg.lstsq(n[: T - 2], y).solution.t()         # [vocab, H]: exact when T-2 <= H

    def r(*s):
        return torch.randn(*s, generator=g) * s[-1] ** -0.5
    L = "layers.0."
    w = {"fc.weight": fc, "embed_tokens.weight": torch.zeros(vocab, H),
         L + "self_attn.q_proj.weight": r(H, 2 * H), L + "self_attn.k_proj.weight": r(H // 2, 2 * H),
         L + "self_attn.v_proj.weight": r(H // 2, 2 * H), L + "self_attn.o_proj.weight": torch.zeros(H, H),
         L + "mlp.gate_proj.weight": r(2 * H, H), L + "mlp.up_proj.weight": r(2 * H, H),
         L + "mlp.down_proj.weight": torch.zeros(H, 2 * H), L + "input_layernorm.weight": torch.ones(H),
         L + "hidden_norm.weight": torch.ones(H), L + "post_attention_layernorm.weight": torch.ones(H),
         "norm.weight": torch.ones(H), "lm_head.weight": lm}
    return write_draft(out, w, config(H, vocab, ids))
