"""The EAGLE-3 draft checkpoint: read (safetensors, or weights_only .bin/.pt) and checked against its config.json;
written the way SpecForge writes one."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ...core.errors import CaptureError, UsageError

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
    from ...formats.specforge import safe_torch_load
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
            raise UsageError(f"--draft {path}: no embed_tokens.weight (the engine copies it from the target model): "
                             f"pass --embed with the target's folder, or a file with its embedding table "
                             f"[{vocab}, {hidden}]")
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


TARGET_EMBED = "model.embed_tokens.weight"


def _load_embed(p: Path, vocab: int, hidden: int) -> torch.Tensor:
    """The target's embedding table: from the target's folder (its safetensors' model.embed_tokens.weight, read
    alone), a safetensors file holding that tensor among others, or a file holding one [vocab, hidden] tensor."""
    from safetensors import safe_open
    if p.is_dir():
        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                if TARGET_EMBED in st.keys():
                    return st.get_tensor(TARGET_EMBED)
        raise UsageError(f"--embed {p}: a folder with no {TARGET_EMBED} in its safetensors; give the target model's "
                         f"folder, or a file with its embedding table [{vocab}, {hidden}]")
    if not p.is_file():
        raise UsageError(f"--embed {p}: no such file or folder; expected the target model's folder or its embedding "
                         f"table [{vocab}, {hidden}]")
    if p.suffix == ".safetensors":
        with safe_open(str(p), "pt") as st:
            if TARGET_EMBED in st.keys():
                return st.get_tensor(TARGET_EMBED)
        from safetensors.torch import load_file
        t = load_file(str(p))
    else:
        from ...formats.specforge import safe_torch_load
        t = safe_torch_load(p)
    if isinstance(t, dict):
        cands = [v for k, v in t.items() if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == hidden]
        t = cands[0] if len(cands) == 1 else None
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise UsageError(f"--embed {p}: expected one [{vocab}, {hidden}] tensor")
    return t


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
