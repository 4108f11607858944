"""The draft forward: tpprobe's re-implementation (torch, any device) and SGLang's own class (CPU), and
which one runs where (--engine, --device)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .draft import Draft
from ...core.errors import UsageError


# ---- the draft forward: a re-implementation (torch) and SGLang's own class -----------------------
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


class SGLangEagle3:
    """SGLang's own `LlamaForCausalLMEagle3` on CPU (tp 1 in this process), weights through its
    `load_weights` (legacy names, d2t handling and all). Logits are its final hidden state times
    its lm_head (the logits processor itself keeps only the last token of an EXTEND batch)."""

    def __init__(self, d: Draft):
        from ...engines.sglang import require
        require()
        from ...engines.sglang import cpu_mode
        cpu_mode.enable()
        _init_single_process()
        from transformers import LlamaConfig
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

        c = dict(d.config)
        for drop in ("architectures", "auto_map", "_name_or_path", "torch_dtype", "dtype"):
            c.pop(drop, None)
        cfg = LlamaConfig(**c)
        cfg.draft_vocab_size = d.draft_vocab
        self.d = d
        self.device = torch.device("cpu")
        with set_default_torch_dtype(torch.float32):
            self.model = LlamaForCausalLMEagle3(cfg).eval()
        ws = [(("model." if not k.startswith("lm_head") else "") + k, v.float()) for k, v in d.weights.items()]
        if d.d2t is not None:
            ws.append(("d2t", d.d2t))
        self.model.load_weights(ws)

    def logits(self, feats, next_ids):
        from types import SimpleNamespace
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        rt = SimpleNamespace(ids=next_ids, model=self.model, config=SimpleNamespace(num_hidden_layers=1),
                             dtype=torch.float32, mla=False, capture=False, attn_dp=1)
        from ...engines.sglang.tiny import extend_batch
        fb, backend = extend_batch(rt)
        fb.spec_info = SimpleNamespace(hidden_states=feats.float())
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(fb)
            h, _ = self.model.model(next_ids, fb.positions, fb)
        return h @ self.model.lm_head.weight[: self.d.draft_vocab].t()


def _init_single_process() -> None:
    import tempfile
    import torch.distributed as dist
    if dist.is_initialized():
        return
    f = tempfile.NamedTemporaryFile(prefix="tpprobe-accept-", delete=False)
    f.close()
    dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
    from ...engines.sglang.dist import publish_parallel_state
    publish_parallel_state(0, 1, 0, "gloo", "cpu")


ENGINES = ("auto", "sglang", "torch")


def resolve_device(device: str, engine: str) -> torch.device:
    """The device the draft runs on, from --device and --engine (checked before anything is
    loaded): auto = cuda when torch sees one (cpu for --engine sglang), else cpu."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: use auto, sglang or torch")
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
    if dev.startswith("cuda") and engine == "sglang":
        raise UsageError(f"--engine sglang --device {device}: SGLang's class runs on CPU in this tool; use "
                         f"--engine torch on GPU (or --device cpu for SGLang's class)")
    has = torch.cuda.is_available()
    if dev == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if has and engine != "sglang" else torch.device("cpu")
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
    if device is not None and device.type != "cpu":      # resolve_device has refused --engine sglang here
        why = ("" if name == "torch" else
               f"; --engine auto on {device}: SGLang's class runs on CPU in this tool")
        return Eagle3Forward(d, device), f"torch (tpprobe's re-implementation of LlamaForCausalLMEagle3{why})"
    if name == "torch":
        return Eagle3Forward(d), "torch (tpprobe's re-implementation of LlamaForCausalLMEagle3)"
    if name == "auto":
        try:
            import sglang  # noqa: F401
        except ImportError:
            return Eagle3Forward(d), "torch (sglang is not installed; tpprobe's re-implementation)"
    if name not in ENGINES:
        raise UsageError(f"--engine {name!r}: use auto, sglang or torch")
    from ...engines import sglang as sg
    return SGLangEagle3(d), f"sglang {sg.SGLANG_VERSION} LlamaForCausalLMEagle3 (CPU)"
