"""The target's own greedy next token at every position of a captured prompt, from its folder's weights.

A draft is verified against the tokens the TARGET samples, not against the prompt: a replay that scores the draft
against the prompt's next tokens measures nothing on a prompt the target would not have written. The captured last
layer's output (HF hidden_states[L], before the final norm) gives the target's greedy choice at every position: its
final RMSNorm (`model.norm.weight`, `rms_norm_eps`) and its head (`lm_head.weight`, or the embedding when tied) are
read from the target's safetensors, nothing else is loaded, and the head is applied a block of the vocabulary at a
time (a Kimi-size head in float32 would be 4.7 GB)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

# model types whose final norm is a plain RMSNorm (x / rms(x) * w) and whose logits are the head's product: what
# this reads. Others (Gemma's 1 + w, soft-capped or scaled logits) are said, never guessed.
PLAIN_RMSNORM = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2",
                 "deepseek_v3", "kimi_k2", "glm4_moe", "phi3"}
NORM, HEAD, EMBED = "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"
VOCAB_BLOCK = 16384


def _tensors(folder: Path, names: set) -> dict:
    """The norm's tensor, and (file, key) of the head, from the folder's safetensors (headers only, but the norm)."""
    from safetensors import safe_open
    got: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in names & set(st.keys()):
                got[k] = st.get_tensor(k) if k == NORM else (str(f), k)
        if len(got) == len(names):
            break
    return got


def greedy_next(target: Optional[str], last: torch.Tensor) -> tuple[Optional[torch.Tensor], str]:
    """(next[t] for every row t of `last` (the target's greedy token after token t), how) or (None, why not)."""
    if not target or not Path(target).is_dir():
        return None, f"the target's folder is not known or not here ({target!r})"
    folder = Path(target)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        return None, f"{folder}/config.json: {type(e).__name__}"
    cfg = cfg.get("text_config") or cfg
    mt = str(cfg.get("model_type") or "")
    if mt not in PLAIN_RMSNORM:
        return None, f"the target's final norm and head are not read for model_type {mt!r}"
    tied = bool(cfg.get("tie_word_embeddings", False))
    head_name = EMBED if tied else HEAD
    got = _tensors(folder, {NORM, head_name})
    if NORM not in got or head_name not in got:
        return None, f"{folder}: no {NORM} and {head_name} in its safetensors"
    if int(got[NORM].numel()) != int(last.shape[-1]):
        return None, f"the target's norm is {int(got[NORM].numel())} wide, the captured stream {int(last.shape[-1])}"
    from safetensors import safe_open
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    x = last.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * got[NORM].float()
    path, key = got[head_name]
    best_v = torch.full((x.shape[0],), float("-inf"))
    best_i = torch.zeros(x.shape[0], dtype=torch.int64)
    with safe_open(path, "pt") as st:
        sl = st.get_slice(key)
        vocab = int(sl.get_shape()[0])
        for lo in range(0, vocab, VOCAB_BLOCK):
            w = sl[lo:lo + VOCAB_BLOCK].float()
            v, i = (x @ w.T).max(-1)
            better = v > best_v
            best_v = torch.where(better, v, best_v)
            best_i = torch.where(better, i + lo, best_i)
    return best_i, f"the target's own greedy tokens ({NORM} and {head_name} of {folder.name} on the last layer)"


MIN_DECODE_LIKE = 3       # positions a replay needs where the prompt goes on as the target would


def score_on_target(streams, target) -> tuple[str, str]:
    """(what a replay scores the draft against, "") or ("", why it cannot run). The draft is verified against
    the tokens the target samples: with the target's head readable (greedy_next), against the target's own token
    at the positions where the prompt goes on as the target would (`streams.next_ids` is set); else against the
    prompt's tokens, and said."""
    nxt, how = greedy_next(target, streams.by_hf[streams.num_layers])
    if nxt is None:
        return f"scored against the prompt's next tokens (the target's own could not be read: {how})", ""
    streams.next_ids = nxt
    n, T = streams.decode_like, streams.input_ids.numel()
    if n < MIN_DECODE_LIKE:
        return "", (f"the captured prompt is not text the target writes: {n} of its {T - 1} next tokens are the "
                    f"target's own greedy choice, and the draft is verified against the target's tokens; capture "
                    f"a prompt the target wrote (its own greedy output fed back) for a replay")
    return f"scored against {how} at the {n} of {T - 1} positions where the prompt follows them", ""
