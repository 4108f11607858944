"""The residual stream of vLLM's decoder layers, read where vLLM completes it: at the next norm.

A vLLM decoder layer returns `(hidden_states, residual)` and the stream is their sum, but vLLM lets a
layer defer its last reduce (a RowParallelLinear with `reduce_results=False`, vLLM's "the caller
reduces"; `ResidualStream` / `Scatter.PARTIAL` move that into model code) and complete it later, before
or inside the next norm (on GPUs the fused all-reduce + RMSNorm). Read at the layer's output, such a
stream is each rank's partial sum even when the model is right, and a capture that reads it before the
reduce completes (F28) looks like the layer's fault. So `layer.K.out` is recorded where the stream is
complete: the residual the next layer's `input_layernorm(hidden, residual)` returns (hidden + residual,
after any reduce issued on its way in), and for the last layer the final norm's. In a model that
reduces inside each layer (vLLM 0.32.0's own) this is the same value the layer's output gives.

Used by the CPU probe (tpprobe.engines.vllm.tiny) and vLLM's plugin; imports nothing from vllm.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tpprobe.capture.points import layer_out


def _stream_of_norm(output) -> Optional[torch.Tensor]:
    """norm(hidden, residual) -> (normed, hidden + residual): the second is the stream."""
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[1], torch.Tensor):
        return output[1]
    return None


def norms_after(model) -> Optional[list]:
    """For each decoder layer K, the norm that completes the stream leaving it (layer K+1's input_layernorm,
    the final norm for the last layer), or None when the model is not built that way."""
    inner = getattr(model, "model", model)
    layers = list(getattr(inner, "layers", None) or [])
    final = getattr(inner, "norm", None)
    nxt = [getattr(layer, "input_layernorm", None) for layer in layers[1:]] + [final]
    if not layers or not all(isinstance(m, torch.nn.Module) for m in nxt):
        return None
    return nxt


def hook_norms(norms: list, record: Callable[[int, torch.Tensor], None]) -> list:
    """A forward hook on each norm: record(K, the stream it returns) for the layer K it completes."""
    def post_for(k: int):
        def post(mod, args, output):
            s = _stream_of_norm(output)
            if s is not None:
                record(k, s)
        return post

    return [norm.register_forward_hook(post_for(k)) for k, norm in enumerate(norms)]


def _has_residual(output) -> bool:
    return isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[0], torch.Tensor) \
        and isinstance(output[1], torch.Tensor)


def residual_stream_extension(tap) -> list:
    """Tap extension: `layer.K.out` for every decoder layer K of a vLLM model, read at the norm after it; a
    layer that returns no separate residual (Granite's, Cohere's) is read at its output as before."""
    norms = norms_after(tap.model)
    if norms is None:
        return []         # the Tap reads hidden + residual from the layer's output, as before
    tap.stream_from_extension = True
    layers = list(getattr(getattr(tap.model, "model", tap.model), "layers", None) or [])

    def record(k: int, v: torch.Tensor) -> None:
        # a copy now: a fused add + RMSNorm (vLLM's CUDA kernel) updates the residual in place in the next norm,
        # and a fingerprint may be taken later on a side stream
        tap.record_point(layer_out(k), v.detach().clone(), copied=True)

    def layer_post_for(k: int):
        def post(mod, args, output):
            if not _has_residual(output):       # the layer's output is the stream: no norm completes it
                s = output if isinstance(output, torch.Tensor) else output[0] \
                    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) else None
                if s is not None:
                    record(k, s)
        return post

    handles = [layer.register_forward_hook(layer_post_for(k)) for k, layer in enumerate(layers)]
    return handles + hook_norms(norms, lambda k, v: record(k, v))
