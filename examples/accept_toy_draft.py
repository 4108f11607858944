"""Train a toy EAGLE-3 draft on a healthy capture, then ask `tpprobe accept` what a broken capture
costs it. Used by tests/ranks/test_accept.py (which imports `train` from here) and runnable on its own:

    python -m examples.accept_toy_draft [WORKDIR]

It probes the built-in model twice (healthy, and `--inject slot-order`, catalogue F8) with a small
vocabulary and embedding rows at a trained model's scale (`--embed-std 0.01`), trains a draft head
on the healthy run's aux features in a few seconds (draft hidden 64, vocab 8, a zero token
embedding so it must read the aux features), saves it as SpecForge saves a draft, and runs
`tpprobe accept --fix` on the two captures. See docs/accept.md.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

H, V = 64, 8      # vocab 8: no token alone names its position, so the draft needs every slot's context
IDS = [-1, 1, 3]
TOKENS = 192
EMBED_STD = 0.01  # the built-in model's embedding rows at a trained model's scale (its default, 1.0, is
#                   what a norm leaves almost unchanged: then F13 `embed-after-norm` would cost nothing)


def probe_args() -> list[str]:
    """The built-in model every capture here is taken from (`tpprobe probe` options)."""
    return ["--tokens", str(TOKENS), "--vocab", str(V), "--layers", ",".join(map(str, IDS)),
            "--embed-std", str(EMBED_STD)]


def config(hidden: int = H, vocab: int = V, ids=IDS) -> dict:
    """An HF config.json for a single-layer LlamaForCausalLMEagle3 draft, as SpecForge writes it."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 8, "num_key_value_heads": 4,
            "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
            "target_hidden_size": hidden, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}


def init_weights(hidden: int = H, vocab: int = V, k: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    h = hidden

    def r(*s):
        return torch.randn(*s, generator=g) * s[-1] ** -0.5
    L = "layers.0."
    return {"fc.weight": r(h, k * h), "embed_tokens.weight": torch.zeros(vocab, h),
            L + "self_attn.q_proj.weight": r(h, 2 * h), L + "self_attn.k_proj.weight": r(h // 2, 2 * h),
            L + "self_attn.v_proj.weight": r(h // 2, 2 * h), L + "self_attn.o_proj.weight": r(h, h),
            L + "mlp.gate_proj.weight": r(2 * h, h), L + "mlp.up_proj.weight": r(2 * h, h),
            L + "mlp.down_proj.weight": r(h, 2 * h), L + "input_layernorm.weight": torch.ones(h),
            L + "hidden_norm.weight": torch.ones(h), L + "post_attention_layernorm.weight": torch.ones(h),
            "norm.weight": torch.ones(h), "lm_head.weight": r(vocab, h)}


def capture(run_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux.packed, input_ids) of rank 0 of a probe capture folder."""
    from safetensors.torch import load_file
    t = load_file(str(Path(run_dir) / "rank-000.safetensors"))
    return t["aux.packed"], t["input_ids"].to(torch.int64)


def train(feats: torch.Tensor, ids: torch.Tensor, out, vocab: int = V, steps: int = 800) -> Path:
    """A draft trained on `feats` (aux.packed, [T, K*H]): it learns the sequence's next-next tokens
    from the aux features alone (its token embedding is zero and frozen, so it cannot shortcut
    through token t+1). The draft vocabulary is a permutation of the target's, so d2t must be
    honoured to score it. Written to `out` as SpecForge writes a draft."""
    from tpprobe.eagle3.accept.draft import Draft, write_draft
    from tpprobe.eagle3.accept.engines import Eagle3Forward
    hidden = feats.shape[-1] // 3
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))      # draft index -> target id
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(vocab)
    cfg = config(hidden, vocab)
    d = Draft(path=Path(out), config=cfg, weights=init_weights(hidden, vocab), hidden=hidden,
              target_hidden=hidden, k=3, layer_ids=IDS, vocab=vocab, draft_vocab=vocab, heads=8, kv_heads=4,
              head_dim=hidden // 8, eps=1e-6, rope_theta=10000.0, d2t=perm - torch.arange(vocab))
    m = Eagle3Forward(d)
    trainable = [p for n, p in m.p.items() if n != "embed_tokens__weight"]     # the embedding is the target's
    opt = torch.optim.Adam(trainable, lr=1e-2)
    T = ids.numel()
    x, nxt, y = feats[: T - 2].float(), ids[1: T - 1], inv[ids[2:]]
    torch.manual_seed(0)
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(m.logits(x, nxt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49 and (m.logits(x, nxt).argmax(-1) == y).float().mean() > 0.98:
            break
    ws = {n.replace("__", "."): p.detach().clone() for n, p in m.p.items()}
    ws["d2t"] = (perm - torch.arange(vocab)).to(torch.int64)
    ws["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return write_draft(out, ws, cfg)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    work = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="tpprobe-accept-"))
    work.mkdir(parents=True, exist_ok=True)
    common = [*probe_args(), "--quiet"]
    for name, extra in (("healthy", []), ("slot-order", ["--inject", "slot-order"])):
        subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--out", str(work / name),
                        *common, *extra], check=False)
    feats, ids = capture(work / "healthy")
    draft = train(feats, ids, work / "draft")
    cmd = [sys.executable, "-m", "tpprobe", "accept", "--draft", str(draft), "--baseline", str(work / "healthy"),
           "--target", str(work / "slot-order"), "--fix"]
    print("$ tpprobe accept --draft", draft, "--baseline", work / "healthy", "--target", work / "slot-order", "--fix")
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
