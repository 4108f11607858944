"""The draft forward: tpprobe's re-implementation (torch, any device) and an engine's own class (SGLang's, CPU:
tpprobe.engines.sglang.eagle3_draft), and which one runs where (--engine, --device)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .draft import Draft
from ...core.errors import UsageError
from ...engines.registry import DRAFT_ENGINES


# ---- the draft forward: a re-implementation (torch) -------------------------------------------------
def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, pos, theta):
    # neox style (HF Llama rotate_half), as SGLang's get_rope for Llama
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Eagle3Forward(torch.nn.Module):
    """SGLang 0.5.23's `LlamaForCausalLMEagle3` forward for one EXTEND sequence (llama_eagle3.py),
    written in plain torch so it also trains: fc -> midlayer(cat[norm(embed), hidden_norm(h)]) ->
    norm -> lm_head. Parameters use the checkpoint's (normalized) names."""

    def __init__(self, d: Draft, device: Optional[torch.device] = None):
        super().__init__()
        self.d = d
        dev = torch.device("cpu") if device is None else device     # moved as stored, upcast there
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.to(dev).float().clone())
                                         for k, v in d.weights.items()})

    def w(self, name):
        return self.p[name.replace(".", "__")]

    @property
    def device(self) -> torch.device:
        return self.w("fc.weight").device

    def hidden(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        d = self.d
        L = "layers.0."
        T = feats.shape[0]
        h = feats.float() @ self.w("fc.weight").t()
        if "fc.bias" in d.weights:
            h = h + self.w("fc.bias")
        emb = F.embedding(next_ids, self.w("embed_tokens.weight"))
        residual = h
        x = torch.cat([_rms(emb, self.w(L + "input_layernorm.weight"), d.eps),
                       _rms(h, self.w(L + "hidden_norm.weight"), d.eps)], dim=-1)
        q = (x @ self.w(L + "self_attn.q_proj.weight").t()).view(T, d.heads, d.head_dim)
        k = (x @ self.w(L + "self_attn.k_proj.weight").t()).view(T, d.kv_heads, d.head_dim)
        v = (x @ self.w(L + "self_attn.v_proj.weight").t()).view(T, d.kv_heads, d.head_dim)
        pos = torch.arange(T, device=feats.device)
        q, k = _rope(q, pos, d.rope_theta), _rope(k, pos, d.rope_theta)
        rep = d.heads // d.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True)[0]
        a = a.transpose(0, 1).reshape(T, d.heads * d.head_dim) @ self.w(L + "self_attn.o_proj.weight").t()
        residual = a + residual
        y = _rms(residual, self.w(L + "post_attention_layernorm.weight"), d.eps)
        y = (F.silu(y @ self.w(L + "mlp.gate_proj.weight").t()) * (y @ self.w(L + "mlp.up_proj.weight").t())
             ) @ self.w(L + "mlp.down_proj.weight").t()
        return _rms(y + residual, self.w("norm.weight"), d.eps)

    def logits(self, feats, next_ids):
        return self.hidden(feats, next_ids) @ self.w("lm_head.weight")[: self.d.draft_vocab].t()


# auto | an engine with its own draft class (tpprobe.engines.registry: sglang) | torch; auto runs the first
# such engine's class when it imports, else the torch re-implementation
ENGINES = ("auto", *DRAFT_ENGINES, "torch")


def resolve_device(device: str, engine: str) -> torch.device:
    """The device the draft runs on, from --device and --engine (checked before anything is
    loaded): auto = cuda when torch sees one (cpu for --engine sglang), else cpu."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use {', '.join(ENGINES[:-1])} or {ENGINES[-1]}")
    dev = (device or "auto").strip().lower()
    idx = None
    if dev.startswith("cuda:"):
        try:
            idx = int(dev[5:])
        except ValueError:
            idx = -1
        if idx < 0:
            raise UsageError(f"--device {device!r}: use auto, cpu, cuda or cuda:N (N a GPU index)")
    elif dev not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    own = DRAFT_ENGINES.get(engine)
    cpu_only = own is not None and own.draft_cpu_only
    if dev.startswith("cuda") and cpu_only:
        raise UsageError(f"--engine {engine} --device {device}: {own.title}'s class runs on CPU in this tool; use "
                         f"--engine torch on GPU (or --device cpu for {own.title}'s class)")
    has = torch.cuda.is_available()
    if dev == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if has and not cpu_only else torch.device("cpu")
    if dev == "cpu":
        return torch.device("cpu")
    if not has:
        raise UsageError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}); "
                         f"use --device cpu (or auto)")
    n = torch.cuda.device_count()
    if idx is None:
        idx = torch.cuda.current_device()
    if idx >= n:
        raise UsageError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1}); "
                         f"pick one of those")
    return torch.device("cuda", idx)


def engine_for(d: Draft, name: str, device: Optional[torch.device] = None):
    auto = next(iter(DRAFT_ENGINES.values()))
    if device is not None and device.type != "cpu":      # resolve_device has refused a CPU-only class here
        why = ("" if name == "torch" else
               f"; --engine auto on {device}: {auto.title}'s class runs on CPU in this tool")
        return Eagle3Forward(d, device), f"torch (tpprobe's re-implementation of LlamaForCausalLMEagle3{why})"
    if name == "torch":
        return Eagle3Forward(d), "torch (tpprobe's re-implementation of LlamaForCausalLMEagle3)"
    if name == "auto":
        if not auto.importable():
            return Eagle3Forward(d), f"torch ({auto.name} is not installed; tpprobe's re-implementation)"
        name = auto.name
    if name not in ENGINES:
        raise UsageError(f"--engine {name!r}: use {', '.join(ENGINES[:-1])} or {ENGINES[-1]}")
    return DRAFT_ENGINES[name].draft_forward(d)
