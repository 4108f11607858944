"""A tiny Llama target with planted structure and an EAGLE-3 draft that reads one slot: acceptance that means something.

    python -m tpprobe.engines.vllm.planted OUT [--ids 1,2,3] [--read-slot 1] [--trained-ids 1,2,3]

writes OUT/target (LlamaForCausalLM) and OUT/draft (LlamaForCausalLMEagle3), HF folders (config.json and
model.safetensors) that vLLM loads as they are: `LLM(model=OUT/target, speculative_config={"method": "eagle3",
"model": OUT/draft, "num_speculative_tokens": 1})`. Random weights accept nothing; these are built by hand so the
draft's prediction depends on exactly one stream of the target:

* target (hidden 256, 4 layers, vocab 512, fp32): the embedding writes a token's code (48 numbers, every code the
  same length) into block 0 (dims 0..47) and a constant C into dim 255. Attention writes nothing (o_proj = 0).
  Layer k's MLP MOVES the code from block k to block k+1 (its gate reads the constant, so SiLU is linear there),
  so the stream entering layer k (vLLM id k = HF hidden_states[k]) holds the code in block k and nowhere else:
  every id's stream is told apart by where the code sits. The head reads block N: the next token is f(token), f a
  fixed permutation. Greedy text is f, f(f), ... from the prompt's last token.
* draft: `fc` copies block X of slot `read_slot` (and its constant) into its own block 0 (and dim 255); its MLP,
  gated by that constant, copies block 0 to block 1; its head reads block 1 and predicts f(f(token)), the token
  vLLM verifies the draft's row against (the row of token t is checked against token t + 2). So the draft is right
  only when slot `read_slot` holds stream X (X = the id the draft was trained with in that slot) with its residual:
  one layer early or late, or the layer's output without the residual (constant 0: the MLP stays shut), and the
  head reads zeros: acceptance 0.

`trained_ids` are the ids in the slots the draft was built for (slot s holds stream trained_ids[s]); `ids` is
what its config.json says (eagle_aux_hidden_state_layer_ids): a config that is not what the draft was trained on
is written by giving both.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional, Sequence

import torch

H, L, V, BLOCK, CONST = 256, 4, 512, 48, 255
HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 2, 64, 512
C = math.sqrt(BLOCK)            # the constant: |code|^2 = 48 = C^2
EPS = 1e-6
Z = 20.0                        # the gate's value: SiLU(20) = 20 in float32
SEED = 1234


def codes(seed: int = SEED) -> torch.Tensor:
    """[V, BLOCK] token codes, each of length sqrt(BLOCK) (so every stream has the same RMS)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(V, BLOCK, generator=g, dtype=torch.float64)
    return (c / c.norm(dim=1, keepdim=True) * math.sqrt(BLOCK)).float()


def next_token(seed: int = SEED) -> list[int]:
    """f: the target's greedy next token of each token (a fixed permutation)."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randperm(V, generator=g).tolist()


def _block(k: int) -> slice:
    return slice(BLOCK * k, BLOCK * (k + 1))


def _neuron(i: int) -> int:
    """The MLP neuron of code dim i: half on each TP rank's shard of the intermediate (so a reduce matters)."""
    return i if i < BLOCK // 2 else FFN // 2 + i - BLOCK // 2


def _crossed(i: int) -> int:
    """The neuron of code dim i on the OTHER TP rank's half from `_neuron`'s."""
    return FFN // 2 + i if i < BLOCK // 2 else i - BLOCK // 2


def _mover(src: int, dst: int, gate_in: float, keep: bool, neuron=_neuron) -> dict:
    """gate/up/down weights of an MLP whose output moves (keep=False: subtract src) or copies block src to dst,
    its input normalised by an RMSNorm of RMS sqrt(ms + eps) where the constant reads `gate_in`."""
    gate = torch.zeros(FFN, H)
    up = torch.zeros(FFN, H)
    down = torch.zeros(H, FFN)
    s = math.sqrt(2 * BLOCK / H + EPS)       # the stream's RMS: code and constant, |x|^2 = 2 * BLOCK
    G = Z / gate_in                          # the gate reads Z: SiLU(Z) = Z
    a = s / Z                                # up reads x / s: a * Z * x / s = x
    for i in range(BLOCK):
        n = neuron(i)
        gate[n, CONST] = G
        up[n, _block(src).start + i] = 1.0
        down[_block(dst).start + i, n] = a
        if not keep:
            down[_block(src).start + i, n] = -a
    return {"gate_proj": gate, "up_proj": up, "down_proj": down}


def _attention(g: torch.Generator, width: int) -> dict:
    return {"q_proj": torch.randn(HEADS * HEAD_DIM, width, generator=g) * 0.02,
            "k_proj": torch.randn(KV_HEADS * HEAD_DIM, width, generator=g) * 0.02,
            "v_proj": torch.randn(KV_HEADS * HEAD_DIM, width, generator=g) * 0.02,
            "o_proj": torch.zeros(H, HEADS * HEAD_DIM)}


def _llama_config(**kw) -> dict:
    cfg = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "intermediate_size": FFN, "vocab_size": V, "max_position_embeddings": 256, "rms_norm_eps": EPS,
           "hidden_act": "silu", "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False}
    cfg.update(kw)
    return cfg


def _save(folder: Path, config: dict, weights: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous().float() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def build_target(folder: Path, seed: int = SEED) -> Path:
    """The planted target (see the module's doc)."""
    g = torch.Generator().manual_seed(seed + 2)
    code, f = codes(seed), next_token(seed)
    embed = torch.zeros(V, H)
    embed[:, _block(0)] = code
    embed[:, CONST] = C
    inv = [0] * V
    for t, u in enumerate(f):
        inv[u] = t
    head = torch.zeros(V, H)
    head[:, _block(L)] = code[inv]          # row u scores the code of the token whose next token is u
    w = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(H)}
    s = math.sqrt(2 * BLOCK / H + EPS)
    for k in range(L):
        p = f"model.layers.{k}."
        for name, t in _attention(g, H).items():
            w[p + "self_attn." + name + ".weight"] = t
        for name, t in _mover(k, k + 1, C / s, keep=False).items():
            w[p + "mlp." + name + ".weight"] = t
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
    return _save(Path(folder), _llama_config(architectures=["LlamaForCausalLM"], model_type="llama",
                                             num_hidden_layers=L), w)


def build_draft(folder: Path, ids: Sequence[int], read_slot: int = 1, trained_ids: Optional[Sequence[int]] = None,
                seed: int = SEED, crossed: bool = False) -> Path:
    """The draft: config ids `ids`; it reads slot `read_slot`, built for the slots `trained_ids` (default: `ids`).

    `crossed`: its MLP handles each code dim on the other TP rank (at tp 2) from the target's. By default the
    two split the code the same way, so a draft handed each rank's own partial sum of a target layer (a capture
    before the reduce completes) still sums it back in its own MLP's reduce: a coincidence of this build that
    real weights never have; crossed, each rank's half of the draft finds nothing in its half of the input."""
    trained = list(trained_ids if trained_ids is not None else ids)
    X = int(trained[read_slot])
    n = len(ids)
    if len(trained) != n:
        raise ValueError(f"trained_ids {trained} and ids {list(ids)} differ in length")
    g = torch.Generator().manual_seed(seed + 3)
    code, f = codes(seed), next_token(seed)
    ff = [f[f[t]] for t in range(V)]
    inv = [0] * V
    for t, u in enumerate(ff):
        inv[u] = t
    fc = torch.zeros(H, n * H)
    for i in range(BLOCK):
        fc[i, read_slot * H + _block(X).start + i] = 1.0
    fc[CONST, read_slot * H + CONST] = 1.0
    head = torch.zeros(V, H)
    head[:, _block(1)] = code[inv]
    w = {"fc.weight": fc, "lm_head.weight": head, "norm.weight": torch.ones(H)}
    s = math.sqrt(2 * BLOCK / H + EPS)
    for name, t in _attention(g, 2 * H).items():
        w["midlayer.self_attn." + name + ".weight"] = t
    for name, t in _mover(0, 1, C / s, keep=True, neuron=_crossed if crossed else _neuron).items():
        w["midlayer.mlp." + name + ".weight"] = t
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{name}.weight"] = torch.ones(H)
    cfg = _llama_config(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                        draft_vocab_size=V, target_hidden_size=H, eagle_aux_hidden_state_layer_ids=list(ids),
                        tpprobe_planted={"read_slot": read_slot, "trained_ids": trained})
    return _save(Path(folder), cfg, w)


def expected_tokens(prompt: Sequence[int], n: int, seed: int = SEED) -> list[int]:
    """The target's greedy continuation of `prompt` (f applied to the last token, n times)."""
    f = next_token(seed)
    out, t = [], int(prompt[-1])
    for _ in range(n):
        t = f[t]
        out.append(t)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--ids", default="1,2,3", help="the draft config's eagle_aux_hidden_state_layer_ids")
    p.add_argument("--trained-ids", default=None, help="the ids the draft was built for (default: --ids)")
    p.add_argument("--read-slot", type=int, default=1)
    a = p.parse_args(argv)
    ids = [int(x) for x in a.ids.split(",")]
    trained = [int(x) for x in a.trained_ids.split(",")] if a.trained_ids else None
    t = build_target(a.out / "target")
    d = build_draft(a.out / "draft", ids, a.read_slot, trained)
    print(f"wrote {t} and {d} (config ids {ids}, built for {trained or ids}, reads slot {a.read_slot})")


if __name__ == "__main__":
    main()
