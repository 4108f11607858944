"""How much memory a `--engine sglang|vllm --config` probe needs, from the config and the TP size alone.

Both engines' probes build a model the same way (tpprobe.engines.sglang.tiny, tpprobe.engines.vllm.tiny):
every rank draws the FULL model's weights through the seeded HF model in float32 (identical on every
rank), turns them into the probe's dtype, and keeps its own TP shard in the engine's model. So a rank
holds, at its peak, the full model in float32, a copy in the probe dtype (unless float32) and its shard,
plus the engine's own import. `check(...)` refuses, in one line and before anything is imported or
started, a probe the machine cannot hold, with the number and the ways to shrink the model that keep
its TP structure (hidden size, heads, MLA ranks, the dense/MoE layer pattern): fewer routed experts
(--num-experts), a smaller vocabulary (--vocab-size), fewer layers (--num-layers).

Torch-free (reads the config through tpprobe.config.hub and /proc): it runs in the launcher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tpprobe.config.hub import HubConfig
from tpprobe.core.errors import UsageError

BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
# one rank's engine import, buffers and forward: with it the Kimi-K2.5 shrink of docs/gpu-server-recipe.md
# (tp 2, 2 layers, 2 experts, vocab 1024, float32) is estimated at 5.5 GB a rank; measured peaks 5.0 GB
# (SGLang) and 5.5 GB (vLLM)
ENGINE_BASE = 1.0e9


@dataclass
class Estimate:
    full: int                # parameters of the model the probe builds (all layers, all experts)
    shard: int               # one rank's share of them
    per_rank: int            # bytes at one rank's peak
    ranks: int               # ranks on this machine

    @property
    def total(self) -> int:
        return self.per_rank * self.ranks


def _moe_layers(arch: str, L: int, first_dense: int) -> int:
    if arch == "qwen3_moe":
        return L
    if arch == "deepseek_v2":
        return max(L - min(first_dense, L), 0)
    return 0


def params(hub: HubConfig, arch: str, num_layers: int, tp: int, num_experts: Optional[int] = None,
           vocab: Optional[int] = None) -> tuple[int, int]:
    """(full, one rank's shard) parameter counts of the model `arch` built from `hub` as the probe builds it."""
    g = hub.get
    h = g("hidden_size", default=0)
    V = vocab or g("vocab_size", default=0)
    heads = g("num_attention_heads", default=1)
    L = num_layers
    full = shard = 0

    def add(n: int, split: int = 1) -> None:
        nonlocal full, shard
        full += n
        shard += -(-n // split)

    add(V * h, tp)                                            # VocabParallelEmbedding
    if not hub.text.get("tie_word_embeddings", False):
        add(V * h, tp)                                        # ParallelLMHead
    if arch == "deepseek_v2":                                 # MLA
        q_lora, kv_lora = g("q_lora_rank"), g("kv_lora_rank", default=512)
        nope, rope, v = g("qk_nope_head_dim", default=128), g("qk_rope_head_dim", default=64), \
            g("v_head_dim", default=128)
        attn_rep = h * (kv_lora + rope) + (h * q_lora if q_lora else 0)
        attn_tp = (q_lora or h) * heads * (nope + rope) + kv_lora * heads * (nope + v) + heads * v * h
    else:
        hd = g("head_dim", default=h // max(heads, 1))
        kv = g("num_key_value_heads", default=heads)
        attn_rep = 0
        attn_tp = 2 * heads * hd * h + 2 * kv * hd * h        # kv replicated when kv < tp: counted split
    # as tiny_archs.load_config cuts it: the config's leading dense layers, at least one MoE layer after them
    first = min(g("first_k_dense_replace", default=0), L - 1 if L >= 2 else 0) if arch == "deepseek_v2" else 0
    n_moe = _moe_layers(arch, L, first)
    E = num_experts or g("n_routed_experts", "num_experts", "num_local_experts", default=0)
    ffn, moe_ffn = g("intermediate_size", default=4 * h), g("moe_intermediate_size", default=0)
    shared = g("n_shared_experts", default=0) if arch == "deepseek_v2" else 0
    for i in range(L):
        add(attn_rep)
        add(attn_tp, tp)
        if i >= L - n_moe and E and moe_ffn:
            add(E * 3 * h * moe_ffn, tp)                      # TP-MoE: every expert's MLP split over tp
            add(shared * 3 * h * moe_ffn, tp)
            add(E * h)                                        # the router
        else:
            add(3 * h * ffn, tp)
    return full, shard


def estimate(hub: HubConfig, arch: str, num_layers: int, tp: int, dtype: str, ranks: int,
             num_experts: Optional[int] = None, vocab: Optional[int] = None) -> Estimate:
    full, shard = params(hub, arch, num_layers, tp, num_experts, vocab)
    b = BYTES.get(dtype, 4)
    per_rank = 4 * full + (b * full if b != 4 else 0) + b * shard + int(ENGINE_BASE)
    return Estimate(full, shard, per_rank, ranks)


def available_bytes() -> Optional[int]:
    """Memory this process may still use: MemAvailable, under the cgroup's limit when there is one."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    for lim, cur in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                     ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(lim) as f:
                text = f.read().strip()
            if text == "max":
                continue
            with open(cur) as f:
                left = int(text) - int(f.read().strip())
            avail = left if avail is None else min(avail, left)
        except (OSError, ValueError):
            continue
    return avail


def _size(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    return f"{n / 1e12:.2f} T" if n >= 1e12 else f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def suggestion(hub: HubConfig, arch: str, L: int, tp: int) -> dict:
    """A shrink that keeps the TP structure: the leading dense layers and one MoE layer after them (DeepSeek), as
    many experts as ranks (at least 8, SGLang's MoE wants experts >= tp), a 4096-token vocabulary."""
    out: dict = {}
    first = hub.get("first_k_dense_replace", default=0) if arch == "deepseek_v2" else 0
    want_L = min(L, max(first + 1, 2)) if arch == "deepseek_v2" else min(L, 2)
    if want_L < L:
        out["num_layers"] = want_L
    E = hub.get("n_routed_experts", "num_experts", "num_local_experts")
    if E and E > max(8, tp):
        out["num_experts"] = max(8, tp)
    V = hub.get("vocab_size")
    if V and V > 4096:
        out["vocab"] = 4096
    return out


FLAG = {"num_layers": "--num-layers", "num_experts": "--num-experts", "vocab": "--vocab-size"}


def check(hub: HubConfig, arch: str, num_layers: int, tp: int, dtype: str, ranks: int,
          num_experts: Optional[int] = None, vocab: Optional[int] = None,
          available: Optional[int] = None) -> Estimate:
    """UsageError (one line: the need, what is available, how to shrink) when this machine cannot hold
    the probe's `ranks` ranks; the estimate otherwise."""
    est = estimate(hub, arch, num_layers, tp, dtype, ranks, num_experts, vocab)
    avail = available_bytes() if available is None else available
    if avail is None or est.total <= avail:
        return est
    E = num_experts or hub.get("n_routed_experts", "num_experts", "num_local_experts")
    V = vocab or hub.get("vocab_size")
    now = {"num_layers": num_layers, "num_experts": E, "vocab": V}
    knobs = [f"{FLAG[k]} (now {now[k]})" for k in ("num_experts", "vocab", "num_layers") if now[k]]
    s = suggestion(hub, arch, num_layers, tp)
    s = {k: v for k, v in s.items() if now.get(k) is None or v < now[k]}
    hint = ""
    if s:
        e2 = estimate(hub, arch, s.get("num_layers", num_layers), tp, dtype, ranks,
                      s.get("num_experts", num_experts), s.get("vocab", vocab))
        more = "" if e2.total <= avail else ", still over: use fewer ranks (--nproc) too"
        hint = (f", e.g. {' '.join(f'{FLAG[k]} {v}' for k, v in s.items())} needs about {_size(e2.total)}"
                f"{more}")
    elif ranks > 1:
        hint = ", or fewer ranks (--nproc)"
    raise UsageError(
        f"--config {hub.path} ({hub.describe()}, hidden {hub.get('hidden_size')}) at tp {tp} needs about "
        f"{_size(est.total)} of memory here ({ranks} rank{'s' if ranks > 1 else ''} × {_size(est.per_rank)}: each "
        f"draws the whole {_count(est.full)}-parameter model in float32 for its seeded weights, then keeps its "
        f"{_count(est.shard)}-parameter shard in {dtype}); {_size(avail)} available. Shrink what does not change "
        f"the TP structure (hidden size, heads, MLA ranks and the dense/MoE layer pattern stay the config's): "
        f"{', '.join(knobs)}{hint}")
