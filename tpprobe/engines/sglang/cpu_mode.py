"""CPU test mode for SGLang 0.5.23: every workaround SGLang needs to run without a GPU.

Imported ONLY by the CPU test mode (tpprobe.engines.sglang.tiny, the CPU tests). The live-server plugin
(tpprobe.engines.sglang.plugin) and any GPU code path never import this module.

`enable()` applies all of them (idempotent); call it before the first `import sglang`:

1. torchvision shim. sglang imports torchvision at import time (mem_cache/memory_pool.py ->
   configs -> multimodal/internvl_utils.py). PyPI's torchvision 0.28.0 is a CUDA build whose _C.so
   cannot load on CPU torch; torchvision then fails in _meta_registrations.py ("operator
   torchvision::nms does not exist"). We define those two op schemas right before torchvision is
   first imported. (ci/sglang-cpu/install.sh also installs this as a .pth hook, so plain
   `import sglang` works in that venv.)
2. Rotary embedding. rotary_embedding/base.py imports vllm._custom_ops as a "fallback kernel" on
   any platform that is not cuda/cpu-engine/xpu/npu/...; setting its module flag `_is_cpu = True`
   skips that (forward still resolves to forward_native).
3. MLA attention dispatch. For an extend without prefix the default ("triton") dispatch picks the
   MHA path, which expects a ragged-prefill backend; torch_native reads K/V back from the MLA
   latent cache -> shape mismatch. We register `torch_native` to the absorbed-MLA path.
4. DP attention's row copies (dp_attention.memcpy) use a triton kernel off the CPU engine: we
   point them at SGLang's own memcpy_cpu.
5. Config fields. transformers' DeepseekV3Config lacks `moe_layer_freq`, `topk_method`,
   `scoring_func`, which SGLang reads: `fill_deepseek_config()` sets DeepSeek-V3's values when
   missing. SGLang's CPU rope only supports deepseek_yarn (as real DeepSeek-V3 uses).

Do NOT set SGLANG_USE_CPU_ENGINE=1: it imports sgl_kernel's CPU build, which is not on PyPI.
"""
from __future__ import annotations

import sys

# process-wide by nature: the CPU workarounds patch sglang's modules and define torch ops, once per process
_ENABLED = False
_TV_LIB = None


class _TorchvisionShim:
    """meta_path finder that defines torchvision::nms/qnms schemas just before torchvision loads."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        define_torchvision_ops()
        return None


def define_torchvision_ops() -> None:
    global _TV_LIB
    import torch

    try:
        torch.ops.torchvision.nms  # real _C already loaded (a CPU torchvision)?
        return
    except (AttributeError, RuntimeError):
        pass
    if _TV_LIB is None:
        _TV_LIB = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            _TV_LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined (by the .pth shim)


def install_torchvision_shim() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(type(f).__name__ in ("_TorchvisionShim", "_TVShim") for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionShim())


def patch_rope() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True


def patch_dp_memcpy() -> None:
    """DP attention's gather copies rows with a triton kernel unless SGLang's CPU engine is on;
    use SGLang's own CPU copy (dp_attention.memcpy_cpu)."""
    import sglang.srt.layers.dp_attention as dpa

    dpa.memcpy_func = dpa.memcpy_cpu


def register_mla_torch_native() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry, _dispatch_mla_subtype)

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def fill_deepseek_config(config) -> None:
    """Set the fields SGLang's DeepseekV2 reads that transformers' DeepseekV3Config lacks."""
    for name, value in (("moe_layer_freq", 1), ("topk_method", "noaux_tc"),
                        ("scoring_func", "sigmoid")):
        if getattr(config, name, None) is None:
            setattr(config, name, value)


def quiet_import_noise() -> None:
    """"Cannot detect CUDA architecture." from SGLang's JIT-kernel helper: true and expected on CPU."""
    import logging

    logging.getLogger("sglang.kernels.jit.utils.arch").setLevel(logging.ERROR)


def enable() -> None:
    """Apply every CPU workaround (idempotent). Imports sglang."""
    global _ENABLED
    if _ENABLED:
        return
    import os
    import warnings

    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    quiet_import_noise()
    install_torchvision_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AWQ/GGUF "only CUDA supports ..." import-time noise
        patch_rope()
        register_mla_torch_native()
        patch_dp_memcpy()
    _ENABLED = True
