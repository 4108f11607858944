"""CPU mode for megatron-core 0.16.1: every workaround its forward needs to run without a GPU.

Imported ONLY by CPU tests and examples (examples/megatron_gpt.py); a GPU run of Megatron needs none
of this. Building works as it is (`TransformerConfig(use_cpu_initialization=True)`, a gloo default
group, `get_gpt_layer_local_spec()`: no Transformer Engine). The forward assumes CUDA in five
places, each `AssertionError: Torch not compiled with CUDA enabled` on a CPU build:

1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`;
2. `GlobalMemoryBuffer.get_tensor` (the attention score buffer, megatron/core/utils.py) and
3. `tensor_parallel/mappings.py`'s gather / reduce-scatter output buffers allocate on it;
4. `CudaRNGStatesTracker.fork` around dropout reads and sets the CUDA RNG state.

5. Sequence parallelism with the local spec: `WrappedTorchNorm` (torch's LayerNorm / RMSNorm, the
   norm without Apex or Transformer Engine) refuses `sequence_parallel=True` ("sequence parallel not
   supported by torch LayerNorm"); the flag matters to a norm only in training (its weight's gradient
   is all-reduced across the sequence shards): `cpu_mode()` builds the norm with a copy of the config
   that says False. The norm of a token is the same either way.

`cpu_mode()` (a context manager, around the build and every forward) makes
`torch.cuda.current_device()` answer "cpu" while it is open and puts it back on exit, so 1–3
allocate where the model lives; `enable_rng()` installs Megatron's own inference RNG tracker, whose
`fork()` is a no-op (4: dropout is 0 in inference). Nothing else in Megatron changes.
"""
from __future__ import annotations

import contextlib
import copy

import torch


def _cpu() -> str:
    return "cpu"


@contextlib.contextmanager
def cpu_mode():
    """torch.cuda.current_device() answers "cpu" inside (what Megatron allocates on), and torch norms
    accept a sequence-parallel config (5), then both back."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    saved, saved_new = torch.cuda.current_device, WrappedTorchNorm.__dict__["__new__"]
    orig_new = WrappedTorchNorm.__new__

    def norm_new(cls, config, *args, **kwargs):
        if getattr(config, "sequence_parallel", False):
            config = copy.copy(config)
            config.sequence_parallel = False
        return orig_new(cls, config, *args, **kwargs)

    torch.cuda.current_device = _cpu
    WrappedTorchNorm.__new__ = norm_new
    try:
        yield
    finally:
        torch.cuda.current_device = saved
        WrappedTorchNorm.__new__ = saved_new


def enable_rng() -> None:
    """Megatron's inference RNG tracker: fork() is a nullcontext, no CUDA RNG state is read."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def init_model_parallel(tp: int) -> None:
    """parallel_state over the default (gloo) group, once per process (a test keeps its ranks
    between cases): a different tp size starts it again."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
