"""The residual stream of SGLang 0.5.23 decoder layers, as tpprobe capture points.

SGLang 0.5.23 layers return an opaque `OwedOutput` (the MLP's partial sum, reduced at the next
layer's input boundary), so neither a layer's output nor its `(hidden, residual)` pair is the
stream. This Tap extension records `layer.K.out` (the residual stream leaving layer K = HF
hidden_states[K+1]) where SGLang itself materializes it for EAGLE-3:

* K < L-1: the `capture` callback of layer K+1's `attn_boundary.prepare` (the same callback
  SGLang's own aux capture uses; it completes layer K's owed reduce at that boundary, as EAGLE-3
  capture does; values are unchanged);
* K = L-1: the updated residual returned by the final norm (`model.norm(hidden, residual)`,
  which is what `residual_batch.final_norm`'s capture would see).

`moe_reduce_extension` makes the all-reduce audit see a MoE block (DeepSeek-V2's
`DeepseekV2MoE`) as what it is for TP: a row-parallel producer. The block sums its routed experts
and its shared expert's `down_proj` (a RowParallelLinear with reduce_results=False) into one
tensor that owes ONE all-reduce, issued later at the next boundary. Without this the Tap sees the
shared expert's output as never reduced and attributes the block's reduce to the next layer.

Used by the CPU probe (`tpprobe.engines.sglang.tiny`) and the live-server plugin; imports nothing from
sglang and never imports tpprobe.engines.sglang.cpu_mode (the plugin runs on GPUs).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tpprobe.capture.hooks import LAYER_EXTENSIONS
from tpprobe.capture.points import layer_out


class _Undo:
    def __init__(self, fn: Callable[[], None]):
        self._fn: Optional[Callable[[], None]] = fn

    def remove(self) -> None:
        if self._fn is not None:
            fn, self._fn = self._fn, None
            fn()


def text_model(model):
    """(the *ForCausalLM that holds the decoder layers, its path prefix): a wrapper's `language_model`
    (KimiK25ForConditionalGeneration's DeepseekV3ForCausalLM, "language_model.") or the model itself ("")."""
    inner = getattr(model, "language_model", None)
    if isinstance(inner, torch.nn.Module):
        return inner, "language_model."
    return model, ""


def decoder_layers(model) -> list:
    """SGLang's decoder layers of a *ForCausalLM (model.model.layers; a wrapper's language model's), or []."""
    tm = text_model(model)[0]
    inner = getattr(tm, "model", tm)
    return list(getattr(inner, "layers", None) or [])


def wrap_boundary_captures(layers, record: Callable[[int, torch.Tensor], None]) -> list[_Undo]:
    """Give layer i's attention boundary a capture callback that calls record(i, stream entering
    layer i) for i >= 1 (the stream entering layer 0 is the embedding output). Returns undo handles."""
    undo = []
    for i, layer in enumerate(layers):
        if i == 0:
            continue
        b = getattr(layer, "attn_boundary", None)
        if b is None or not hasattr(b, "prepare"):
            continue
        orig = b.prepare

        def prepare(hidden_states, forward_batch, *a, _i=i, _orig=orig, **kw):
            theirs = kw.pop("capture", None)

            def capture(value, owned=False, _theirs=theirs, _i=_i):
                record(_i, value)
                if _theirs is not None:
                    _theirs(value, owned=owned)

            return _orig(hidden_states, forward_batch, *a, capture=capture, **kw)

        prev = b.__dict__.get("prepare")   # an injected fault's wrapper stays after the probe
        try:
            b.prepare = prepare          # an instance attribute shadows the bound method
        except (AttributeError, TypeError):
            continue
        undo.append(_Undo(lambda b=b, prev=prev: b.__dict__.__setitem__("prepare", prev)
                          if prev is not None else b.__dict__.pop("prepare", None)))
    return undo


def hook_final_norm(model, record: Callable[[torch.Tensor], None]) -> list:
    """Forward hook on the final norm: record the stream leaving the last layer."""
    tm = text_model(model)[0]
    norm = getattr(getattr(tm, "model", tm), "norm", None)
    if not isinstance(norm, torch.nn.Module):
        return []

    def post(mod, args, output):
        if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], torch.Tensor):
            record(output[1])          # norm(hidden, residual) -> (normed, hidden + residual)
        elif args and isinstance(args[0], torch.Tensor) and (len(args) < 2 or args[1] is None):
            record(args[0])            # no separate residual: the input is the stream

    return [norm.register_forward_hook(post)]


def residual_stream_extension(tap) -> list:
    """Tap extension: `layer.K.out` for every decoder layer K of an SGLang 0.5.23 model."""
    layers = decoder_layers(tap.model)
    if not layers:
        return []
    last = len(layers) - 1
    handles = wrap_boundary_captures(layers, lambda i, v: tap.record_point(layer_out(i - 1), v))
    handles += hook_final_norm(tap.model, lambda v: tap.record_point(layer_out(last), v))
    return handles


def moe_reduce_extension(tap) -> list:
    """Tap extension: register each decoder layer's MoE block output as a row-parallel output
    (matched by data_ptr when its owed all-reduce runs), and the row-parallel outputs summed into
    it (the shared expert's down_proj) as consumed by that block."""
    handles = []
    for idx, layer in enumerate(decoder_layers(tap.model)):
        mlp = getattr(layer, "mlp", None)
        # DeepseekV2MoE, Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, ...
        if mlp is None or "moe" not in type(mlp).__name__.lower():
            continue
        name = next((n for n, m in tap.model.named_modules() if m is mlp), f"model.layers.{idx}.mlp")

        def post(mod, args, output, _name=name, _idx=idx):
            out = output if isinstance(output, torch.Tensor) else getattr(output, "routed", None)
            if not isinstance(out, torch.Tensor):
                return
            for row in tap.row_outputs:      # summed into this block's output: reduced with it
                if row["module"].startswith(_name + ".") and not row["reduced"]:
                    row["reduced"], row["into"] = True, _name
            tap.add_row_output(_name, _idx, out)

        handles.append(mlp.register_forward_hook(post))
    return handles


def sglang_extensions() -> tuple:
    """Every Tap extension an SGLang 0.5.23 model needs (for ProbeTarget.tap_extensions / the plugin):
    the residual stream, the MoE block as one producer, and the all-reduce audit at
    GroupCoordinator level (tpprobe.engines.sglang.audit)."""
    from tpprobe.engines.sglang.audit import coordinator_audit_extension

    return (residual_stream_extension, moe_reduce_extension, coordinator_audit_extension)


# the Tap adds these extensions by itself wherever it finds SGLang's layers (a --model factory too), and reads
# the stream from their boundaries (their output is an owed partial sum)
sglang_extensions.stream_at_boundaries = True
LAYER_EXTENSIONS["sglang."] = sglang_extensions
