"""The tiny SGLang models' weights: one full seeded set through the HF model of the same config.

`seeded_hf_model` draws them (identical on every rank; SGLang's own `load_weights` shards them),
`unfuse_experts` gives SGLang's Qwen3-MoE one tensor per expert, and `hf_reference(...)` runs HF
transformers on the same weights and input ids and returns its per-layer hidden states
(hidden_states[0] = embeddings, [i] = input of layer i), so tests can prove what each aux slot holds.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpprobe.engines.sglang.tiny_archs import config_for


def _hf_class(config):
    import transformers

    name = {"llama": "LlamaForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM"}[config.model_type]
    return getattr(transformers, name)


def seeded_hf_model(config, seed: int):
    """HF model of `config` with weights drawn from `seed` only (identical on every rank)."""
    torch.manual_seed(seed)
    hf = _hf_class(config)(config).eval().float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            if p.dim() > 1:   # non-trivial but bounded activations for any width
                p.normal_(0.0, min(0.2, 1.5 / math.sqrt(p.shape[-1])), generator=g)
            else:             # norms etc. away from 1 so a skipped norm is visible
                p.uniform_(0.5, 1.5, generator=g)
    return hf


def seeded_input_ids(vocab: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed + 1))


def hf_reference(arch: str, num_layers: int, tokens: int, seed: int,
                 config_path: Optional[str] = None, moe: bool = True, prenorm_last: bool = False,
                 num_experts: Optional[int] = None, vocab: Optional[int] = None):
    """HF transformers' forward on the same seeded weights and input ids as `build_target`.

    Returns (input_ids [tokens], hidden_states: list of L+1 tensors [tokens, hidden] with
    hidden_states[0] = embedding output and hidden_states[i] = input of decoder layer i
    (the last one is after the final norm, as HF returns it; with prenorm_last=True it is the
    stream leaving the last layer BEFORE the final norm, i.e. what tpprobe's layer.{L-1}.out is),
    logits [tokens, vocab]); all float32.
    """
    config = config_for(arch, num_layers, config_path, moe, num_experts, vocab)
    hf = seeded_hf_model(config, seed)
    ids = seeded_input_ids(config.vocab_size, tokens, seed)
    grabbed = {}
    h = hf.model.norm.register_forward_pre_hook(lambda m, a: grabbed.setdefault("x", a[0].detach().clone()))
    try:
        with torch.no_grad():
            out = hf(ids[None], output_hidden_states=True)
    finally:
        h.remove()
    hs = [x[0] for x in out.hidden_states]
    if prenorm_last:
        hs[-1] = grabbed["x"][0]
    return ids, hs, out.logits[0]


def unfuse_experts(weights):
    """transformers 5 stores an MoE block's experts fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); SGLang's Qwen3-MoE load_weights reads one checkpoint tensor per
    expert (experts.{e}.gate_proj/up_proj/down_proj.weight), as real checkpoints have them."""
    out = []
    for k, v in weights:
        if k.endswith(".mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", v[e, :inter].contiguous()),
                        (f"{base}{e}.up_proj.weight", v[e, inter:].contiguous())]
        elif k.endswith(".mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", v[e].contiguous()) for e in range(v.shape[0])]
        else:
            out.append((k, v))
    return out
