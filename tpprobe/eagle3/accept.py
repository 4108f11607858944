"""`tpprobe accept --draft DRAFT --baseline A --target B`: what a capture costs in accept length.

The EAGLE-3 draft in DRAFT (an HF folder as SpecForge writes it and SGLang loads it: config.json
with `eagle_config`, safetensors with `fc`, the mid layer, `norm`, `lm_head`, `d2t`/`t2d`) runs
once on A's aux features and once on B's (and with `--fix` on B's slots re-ordered by the slot
matcher of `tpprobe diff`), against the target's token sequence, and the two are compared.

How acceptance is estimated (teacher-forced, from one forward per source):
  The draft at position t reads the target's aux features of token t and the embedding of token
  t+1 (SGLang's draft-extend layout) and proposes token t+2. `agree[t]` = its top-1 (mapped to the
  target vocabulary through d2t) equals token t+2 of the sequence, which is taken to be what the
  target produced (greedy). A chain of k drafted tokens started at t accepts the leading run of
  agree[t], agree[t+1], ..., agree[t+k-1]; the expected number of accepted draft tokens for chain
  length k is that run length averaged over every start t where the whole chain fits. SGLang's
  "accept length" counts the target's own token too: accept length = 1 + accepted drafts.
  Step j > 1 of a real chain reads the draft's own hidden state, not the target's features, so
  this is the estimate with the draft's own steps as good as its first: an upper bound on what a
  served chain accepts, and the same bound for both sources, so their difference is what the
  capture costs.

Engines: `sglang` runs SGLang's own `LlamaForCausalLMEagle3` (CPU, one process, torch_native
attention, an EXTEND batch), `torch` a re-implementation of the same forward
(`Eagle3Forward`, proved equal to SGLang's class on the same weights in tests/test_accept.py).
`auto` takes sglang when it is importable.

Devices (`--device auto|cpu|cuda[:N]`): `auto` is cuda when torch sees one, else cpu. The torch
engine runs there: its weights, each source's features and the token ids are moved once, the
logits and their argmax stay on the device, and only the per-position top-1 ids come back (the
d2t map and the accept-length arithmetic are the CPU path's). It computes in float32 on every
device, as on CPU (weights and features are upcast; the draft's own dtype is not used), with TF32
off for its matmuls so a GPU run agrees with a CPU run up to float32 rounding. SGLang's class runs
on CPU in this tool: `--engine sglang` with a cuda device is a usage error, and `--engine auto` on
a cuda device takes the torch engine and says so.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..core.errors import CaptureError, UsageError

SCHEMA = "tpprobe.accept/1"
KS = (1, 2, 3, 4, 5)
ARCHES = ("LlamaForCausalLMEagle3",)
_LEGACY = {"midlayer.": "layers.0.", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
           "aux_norm_high": "fc_norm.2"}


# ---- the draft checkpoint ----------------------------------------------------------------------
@dataclass
class Draft:
    path: Path
    config: dict
    # normalized names: fc.weight, layers.0.*, norm.weight, lm_head.weight, embed_tokens.weight
    weights: dict
    hidden: int
    target_hidden: int
    k: int                        # aux slots the fc takes
    layer_ids: Optional[list]
    vocab: int
    draft_vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    d2t: Optional[torch.Tensor] = None      # draft index i -> target id i + d2t[i]
    notes: list = field(default_factory=list)

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.d2t is None else idx + self.d2t[idx]

    def describe(self) -> dict:
        return {"path": str(self.path), "architecture": self.config.get("architectures", ["?"])[0],
                "hidden": self.hidden, "target_hidden": self.target_hidden, "aux_slots": self.k,
                "layer_ids": self.layer_ids, "vocab": self.vocab, "draft_vocab": self.draft_vocab,
                "vocab_map": "d2t" if self.d2t is not None else "identity", "notes": self.notes}


def _read_tensors(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    out: dict = {}
    if files:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        for f in files:
            try:
                out.update(load_file(str(f)))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CaptureError(f"{f}: not a readable safetensors file ({str(e)[:120]}); expected the draft's "
                                   f"weights as SpecForge saves them")
        return out
    bins = sorted(list(path.glob("*.bin")) + list(path.glob("*.pt")))
    if not bins:
        raise UsageError(f"{path}: no *.safetensors (or pytorch_model.bin) beside config.json; expected an "
                         f"EAGLE-3 draft checkpoint folder as SpecForge writes it")
    from ..formats.specforge import safe_torch_load
    for f in bins:
        d = safe_torch_load(f)
        if not isinstance(d, dict) or not all(isinstance(v, torch.Tensor) for v in d.values()):
            raise CaptureError(f"{f}: not a state dict of tensors; expected the draft's weights")
        out.update(d)
    return out


def _norm_name(k: str) -> str:
    for a, b in _LEGACY.items():
        k = k.replace(a, b)
    for pre in ("model.",):
        if k.startswith(pre):
            k = k[len(pre):]
    return k


def load_draft(path, embed: Optional[str] = None) -> Draft:
    path = Path(path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        raise UsageError(f"--draft {path}: no config.json there; expected an EAGLE-3 draft checkpoint folder "
                         f"(HF config.json with eagle_config, safetensors with fc, midlayer, norm, lm_head)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{cfg_path}: not readable JSON ({e}); expected a HF config.json")
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHES:
        raise UsageError(f"{cfg_path}: architecture {arch!r} is not an EAGLE-3 draft tpprobe can run "
                         f"(supported: {', '.join(ARCHES)})")
    w = {_norm_name(k): v for k, v in _read_tensors(path).items()}
    need = ["fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
            "layers.0.post_attention_layernorm.weight", "norm.weight", "lm_head.weight"]
    missing = [n for n in need if n not in w]
    if missing:
        raise UsageError(f"--draft {path}: weights {missing[:4]} are missing; expected a single-layer EAGLE-3 "
                         f"draft (fc, midlayer.*, norm, lm_head)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{cfg_path}: {e} is missing or not a number; expected hidden_size, "
                         f"num_attention_heads, vocab_size")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise UsageError(f"{cfg_path}: num_hidden_layers is {cfg['num_hidden_layers']}; tpprobe runs the "
                         f"single-layer EAGLE-3 draft only")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    ec = cfg.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    k = cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    fc = w["fc.weight"]
    if tuple(fc.shape) != (hidden, k * target_hidden):
        raise UsageError(f"--draft {path}: fc.weight is {list(fc.shape)} but the config says {k} aux slots × "
                         f"target hidden {target_hidden} -> hidden {hidden}, i.e. [{hidden}, {k * target_hidden}]; "
                         f"the checkpoint and its config.json disagree (eagle_aux_hidden_state_layer_ids, "
                         f"target_hidden_size)")
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    lm = w["lm_head.weight"]
    if lm.shape[0] < draft_vocab or lm.shape[1] != hidden:
        raise UsageError(f"--draft {path}: lm_head.weight is {list(lm.shape)}, expected [{draft_vocab}, {hidden}] "
                         f"(draft_vocab_size × hidden_size)")
    notes = []
    d2t = w.pop("d2t", None)
    w.pop("t2d", None)
    if draft_vocab != vocab and d2t is None:
        raise UsageError(f"--draft {path}: draft_vocab_size {draft_vocab} != vocab_size {vocab} but the checkpoint "
                         f"has no d2t map; its top-1 ids cannot be mapped to the target's vocabulary")
    if d2t is not None:
        d2t = d2t.to(torch.int64).reshape(-1)
        if d2t.numel() != draft_vocab:
            raise UsageError(f"--draft {path}: d2t has {d2t.numel()} entries, expected draft_vocab_size "
                             f"{draft_vocab}")
        tgt = torch.arange(draft_vocab) + d2t
        if int(tgt.min()) < 0 or int(tgt.max()) >= vocab:
            raise UsageError(f"--draft {path}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    if "embed_tokens.weight" not in w:
        if embed is None:
            raise UsageError(f"--draft {path}: no embed_tokens.weight (SGLang copies it from the target model): "
                             f"pass --embed FILE with the target's embedding table [{vocab}, {hidden}]")
        w["embed_tokens.weight"] = _load_embed(Path(embed), vocab, hidden)
        notes.append(f"embedding table from {embed}")
    e = w["embed_tokens.weight"]
    if e.shape[0] < vocab or e.shape[1] != hidden:
        raise UsageError(f"embed_tokens.weight is {list(e.shape)}, expected [{vocab}, {hidden}]")
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_theta", 10000.0)
    return Draft(path=path, config=cfg, weights=w, hidden=hidden, target_hidden=target_hidden, k=int(k),
                 layer_ids=list(ids) if ids else None, vocab=vocab, draft_vocab=draft_vocab, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, eps=float(cfg.get("rms_norm_eps", 1e-6)),
                 rope_theta=float(theta), d2t=d2t, notes=notes)


def _load_embed(p: Path, vocab: int, hidden: int) -> torch.Tensor:
    if not p.is_file():
        raise UsageError(f"--embed {p}: no such file; expected the target's embedding table [{vocab}, {hidden}]")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file
        t = load_file(str(p))
    else:
        from ..formats.specforge import safe_torch_load
        t = safe_torch_load(p)
    if isinstance(t, dict):
        cands = [v for k, v in t.items() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == hidden]
        t = cands[0] if len(cands) == 1 else None
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise UsageError(f"--embed {p}: expected one [{vocab}, {hidden}] tensor")
    return t


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
        from ..engines.sglang import require
        require()
        from ..engines.sglang import cpu_mode
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
        from ..engines.sglang.tiny import extend_batch
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
    from ..engines.sglang.dist import publish_parallel_state
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
    from ..engines import sglang as sg
    return SGLangEagle3(d), f"sglang {sg.SGLANG_VERSION} LlamaForCausalLMEagle3 (CPU)"


# ---- scoring -----------------------------------------------------------------------------------
@contextmanager
def _ieee_fp32(device: torch.device):
    """float32 matmuls without TF32 on cuda (restored after), so GPU and CPU agree to rounding."""
    if device.type != "cuda":
        yield
        return
    mods = (torch.backends.cuda.matmul, torch.backends.cudnn)
    # torch >= 2.9 says fp32_precision ("ieee" = no TF32); mixing it with the legacy allow_tf32 flags
    # is an error there, so each torch gets its own API
    attr, off = ("fp32_precision", "ieee") if hasattr(mods[0], "fp32_precision") else ("allow_tf32", False)
    old = [getattr(m, attr) for m in mods]
    for m in mods:
        setattr(m, attr, off)
    try:
        yield
    finally:
        for m, v in zip(mods, old):
            setattr(m, attr, v)


def agreement(engine, d: Draft, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """agree[t] for t in 0..T-3: the draft's top-1 at t (features t, token t+1) is token t+2.
    The forward and its argmax run on the engine's device; only the T-1 top-1 ids come back."""
    T = ids.numel()
    if T < 3:
        raise UsageError(f"{T} tokens: acceptance needs at least 3 (features t, token t+1, label t+2)")
    dev = getattr(engine, "device", torch.device("cpu"))
    with torch.no_grad(), _ieee_fp32(dev):
        lg = engine.logits(feats[: T - 1].to(dev), ids[1:T].to(dev))
        top = lg.argmax(-1).cpu()
    top = d.to_target(top)
    return top[: T - 2] == ids[2:T]


def accept_lengths(agree: torch.Tensor, ks=KS) -> dict:
    a = agree.to(torch.int64).tolist()
    n = len(a)
    out = {}
    for k in ks:
        starts = range(0, n - k + 1)
        runs = []
        for t in starts:
            r = 0
            while r < k and a[t + r]:
                r += 1
            runs.append(r)
        out[k] = (sum(runs) / len(runs)) if runs else None
    return out


@dataclass
class Scored:
    label: str
    source: str
    usable: bool
    why: str = ""
    top1: Optional[float] = None
    per_position: list = field(default_factory=list)
    accepted: dict = field(default_factory=dict)     # k -> expected accepted draft tokens

    def accept_length(self, k: int = 5) -> float:
        # no draft accepted: the target's own token
        return 1.0 if not self.usable else 1.0 + (self.accepted.get(k) or 0.0)

    def as_dict(self) -> dict:
        return {"label": self.label, "source": self.source, "usable": self.usable, "why": self.why,
                "top1_agreement": self.top1, "per_position": self.per_position,
                "accepted_drafts": {str(k): v for k, v in self.accepted.items()},
                "accept_length": {str(k): (None if not self.usable else 1.0 + (v or 0.0))
                                  for k, v in self.accepted.items()} if self.usable else
                                 {str(k): 1.0 for k in KS}}


def score(engine, d: Draft, label: str, source: str, packed: torch.Tensor, ids: torch.Tensor) -> Scored:
    want = d.k * d.target_hidden
    if packed.shape[-1] != want:
        w = int(packed.shape[-1])
        hint = ""
        if w < want and want % w == 0:
            hint = f" ({want // w}× too narrow: TP-sliced slots, {w // d.k} wide each?)"
        return Scored(label, source, False,
                      why=f"features are {w} wide, the draft's fc takes {d.k} × {d.target_hidden} = {want}{hint}: "
                          f"the draft cannot run on them (SGLang's fc matmul would fail); no draft token is accepted",
                      accepted={k: 0.0 for k in KS})
    if not torch.isfinite(packed).all():
        packed = torch.nan_to_num(packed)
    agree = agreement(engine, d, packed, ids)
    return Scored(label, source, True, top1=float(agree.float().mean()),
                  per_position=[int(x) for x in agree.tolist()], accepted=accept_lengths(agree))


# ---- the command -------------------------------------------------------------------------------
def _sides(baseline, target, tokens_from, rank):
    from .diff.load import load_side
    b = load_side("baseline", baseline, rank)
    t = load_side("target", target, rank)
    tok = load_side("tokens", tokens_from, rank) if tokens_from else None
    if tok is not None and tok.input_ids is None:
        raise UsageError(f"--tokens-from {tokens_from}: it holds no input_ids; pass a capture folder or SpecForge "
                         f"sample that records the token sequence")
    ids = None
    for s in ([tok] if tok else []) + [t, b]:
        if s is not None and s.input_ids is not None:
            ids = s.input_ids.reshape(-1).to(torch.int64)
            src = s.path
            break
    if ids is None:
        raise UsageError("none of the sources has input_ids: pass --tokens-from with a capture or SpecForge "
                         "sample of the same tokens")
    for s in (b, t):
        n = int(s.packed.shape[0])
        if s.input_ids is not None:
            if not torch.equal(s.input_ids.reshape(-1).to(torch.int64), ids):
                raise UsageError(f"{s.role} {s.path} was captured on other tokens than {src}: both sources must "
                                 f"hold the same sequence (the draft is scored on one token sequence)")
        if n != ids.numel():
            raise UsageError(f"{s.role} {s.path} has {n} token rows, the token sequence from {src} has "
                             f"{ids.numel()}: pass --tokens-from with the sequence these features were captured on")
    return b, t, ids, src


def _fixed(b, t, d: Draft):
    """B's slots re-ordered by the diff's slot matcher; (packed, how, explained)."""
    from .diff.compare import default_threshold
    from .diff.load import split_slots
    from .diff.match import diff_sides
    from .diff.tokens import align
    split_slots(b, d.target_hidden, None, t)
    split_slots(t, d.target_hidden, None, b)
    al = align(b, t, None)
    thr = default_threshold(b, t)
    res = diff_sides(b, t, al, [thr] * len(t.slots), thr)
    match = res["match"]
    order, explained = [], True
    for i in range(len(b.slots)):
        js = [j for j, m in enumerate(match) if m == i]
        if js:
            order.append(js[0])
        else:
            explained = False
            order.append(i if i < len(t.slots) else None)
    if any(o is None for o in order):
        return None, "the target has fewer slots than the baseline", False
    how = ", ".join(f"slot {i} ← target slot {j}" for i, j in enumerate(order) if i != j) or "no change"
    packed = torch.cat([t.slots[j] for j in order], dim=-1)
    return packed, how, explained


def run_accept(draft, baseline, target, tokens_from=None, fix=False, engine="auto", embed=None,
               rank=0, tolerance=0.05, device="auto") -> dict:
    dev = resolve_device(device, engine)
    d = load_draft(draft, embed)
    b, t, ids, src = _sides(baseline, target, tokens_from, rank)
    if ids.numel() and (int(ids.max()) >= d.vocab or int(ids.min()) < 0):
        raise UsageError(f"the token sequence from {src} has ids up to {int(ids.max())}, outside the draft's "
                         f"vocabulary [0, {d.vocab}): is this the draft of another model?")
    eng, eng_name = engine_for(d, engine, dev)
    rows = [score(eng, d, "baseline", str(b.path), b.packed, ids),
            score(eng, d, "target", str(t.path), t.packed, ids)]
    fix_info = None
    if fix:
        if t.packed.shape[-1] % d.target_hidden or b.packed.shape[-1] % d.target_hidden:
            fix_info = {"how": "not applied: slot widths do not match the draft's target hidden", "explained": False}
        else:
            packed, how, explained = _fixed(b, t, d)
            fix_info = {"how": how, "explained": explained}
            if packed is not None:
                rows.append(score(eng, d, "target, slots re-ordered", str(t.path), packed, ids))
    K = max(KS)
    base, tgt = rows[0].accept_length(K), rows[1].accept_length(K)
    cost = base - tgt
    line = (f"the target capture costs {cost:.2f} accept length (chain of {K}: {base:.2f} -> {tgt:.2f})"
            if cost > tolerance else
            f"the target capture costs nothing measurable (chain of {K}: {base:.2f} vs {tgt:.2f}, "
            f"tolerance {tolerance})")
    if len(rows) == 3:
        rem = base - rows[2].accept_length(K)
        line += (f"; with slots re-ordered as the matcher proposes ({fix_info['how']}), {rem:.2f} remains"
                 if fix_info["explained"] else
                 f"; re-ordering slots ({fix_info['how']}) does not explain it: {rem:.2f} remains")
    elif fix_info:
        line += f"; --fix {fix_info['how']}"
    if not rows[1].usable:
        line += f" — {rows[1].why}"
    ok = cost <= tolerance
    return {"schema": SCHEMA, "ok": ok, "exit_code": 0 if ok else 1, "line": line, "engine": eng_name,
            "device": str(dev), **({"device_name": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}),
            "draft": d.describe(), "tokens": int(ids.numel()), "tokens_from": str(src),
            "estimate": "teacher-forced: step j of a chain started at t is accepted iff the draft, fed the "
                        "source's features at t+j-1 and token t+j, proposes token t+j+1; accept length = 1 + "
                        "the leading accepted run (SGLang counts the target's own token)",
            "chain_lengths": list(KS), "fix": fix_info, "rows": [r.as_dict() for r in rows],
            "cost": cost, "tolerance": tolerance}


def _on(rep: dict) -> str:
    """` on cuda:0 (NVIDIA H200)` off the CPU; nothing on it (the CPU header reads as before)."""
    dev = rep.get("device", "cpu")
    return "" if dev == "cpu" else f" on {dev}" + (f" ({rep['device_name']})" if rep.get("device_name") else "")


def render(rep: dict, console) -> None:
    from rich.table import Table
    d = rep["draft"]
    console.print(f"[bold]tpprobe accept[/] — draft {d['path']} ({d['architecture']}, {d['aux_slots']} slots × "
                  f"{d['target_hidden']}, vocab map {d['vocab_map']}) · engine {rep['engine']}{_on(rep)} · "
                  f"{rep['tokens']} tokens from {rep['tokens_from']}")
    tab = Table(title="expected accept length for a chain of k drafted tokens (1 + accepted drafts)")
    tab.add_column("source")
    tab.add_column("top-1 agreement", justify="right")
    for k in rep["chain_lengths"]:
        tab.add_column(f"k={k}", justify="right")
    for r in rep["rows"]:
        if not r["usable"]:
            tab.add_row(r["label"], "–", *["1.00"] * len(rep["chain_lengths"]))
            continue
        tab.add_row(r["label"], f"{r['top1_agreement']:.1%}",
                    *[f"{r['accept_length'][str(k)]:.2f}" for k in rep["chain_lengths"]])
    console.print(tab)
    for r in rep["rows"]:
        if not r["usable"]:
            console.print(f"  {r['label']}: {r['why']}")
    style = "green" if rep["ok"] else "bold red"
    console.print(f"[{style}]{'OK' if rep['ok'] else 'COST'}[/]: {rep['line']}")
    console.print(f"[dim]how: {rep['estimate']}[/]")


def markdown(rep: dict) -> str:
    ks = rep["chain_lengths"]
    lines = [f"### tpprobe accept: {'OK' if rep['ok'] else 'COST'}", "", rep["line"], "",
             f"draft `{rep['draft']['path']}` · engine {rep['engine']}{_on(rep)} · {rep['tokens']} tokens", "",
             "| source | top-1 | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|---:|" + "---:|" * len(ks)]
    for r in rep["rows"]:
        if r["usable"]:
            lines.append(f"| {r['label']} | {r['top1_agreement']:.1%} | "
                         + " | ".join(f"{r['accept_length'][str(k)]:.2f}" for k in ks) + " |")
        else:
            lines.append(f"| {r['label']} | unusable | " + " | ".join("1.00" for _ in ks) + " |")
    lines += ["", f"_{rep['estimate']}_", ""]
    return "\n".join(lines)


def write_draft(out, weights: dict, config: dict) -> Path:
    """Write a draft checkpoint folder as SpecForge does (config.json + model.safetensors; the mid
    layer under `midlayer.`). Used by tests and examples that train a draft."""
    from safetensors.torch import save_file
    out = Path(out)
    if not out.parent.exists():
        raise UsageError(f"{out}: its parent folder {out.parent} does not exist")
    out.mkdir(exist_ok=True)
    ws = {k.replace("layers.0.", "midlayer."): v.detach().contiguous() for k, v in weights.items()}
    save_file(ws, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
