"""Fingerprint taps compiled into the model's own graph: torch.compile, and its CUDA graphs (cudagraph trees).

`GraphTap` (graph_tap.py) runs the Tap's Python once, while `torch.cuda.graph` captures a forward by
hand. A model compiled with ``torch.compile(mode="reduce-overhead")`` is different: Dynamo traces
the forward (and the module hooks it finds) into a graph, Inductor compiles it, and cudagraph trees
record and replay the compiled kernels. Python of the Tap inside that region would break the
graph. So `CompiledTaps` hooks each capture point with a hook whose only work is one custom op,

    tpprobe::fp_into(x, buf, slots_id, slot)      # the fused fingerprint of x into slot `slot` of buf
    tpprobe::fp_begin(buf, slots_id)              # the token-flag words zeroed (first point's pre-hook)

which Dynamo traces as an ordinary op (its fake kernel does nothing), Inductor keeps (it mutates the
slot buffer, marked as a static address so cudagraph trees neither copy it nor refuse the
mutation), and cudagraph trees record with the forward: every replay writes the points' partials
at fixed offsets of `StaticFingerprints`' buffer, read after it with one device-to-host copy
(``slots.read()``), the same kernels and the same offsets as the eager `GraphTap`.

    taps = CompiledTaps(model, ids)       # one eager forward: the points, their shapes, the slots
    fast = torch.compile(model, mode="reduce-overhead")
    fast(ids); fast(ids); fast(ids)       # warm-up, record, replay
    fps = taps.read()                     # {capture point: Fingerprint} of the last replay
    taps.remove()                         # hooks gone (the next compiled call recompiles without them)

Install the taps before compiling: Dynamo does not guard on module hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so a model compiled without them keeps running
its graph without them, and one compiled with them keeps its `fp_into` launches after `remove()`
(they then fill nothing when a graph is recorded again) until it is compiled again
(``torch._dynamo.reset()``; with that setting off, the next call after a change recompiles).

The points: the embedding's output, layer 0's input norm and every decoder layer's stream leaving it
(hidden + residual, formed inside the graph), named as the Tap names them (capture/points.py). The
collectives of a tensor-parallel model are not tapped here (no audit runs inside a compiled graph);
a graph is recorded per batch shape, so a `CompiledTaps` is planned per shape too. What is not
exact inside a graph is what `GraphTap` says: NaN / Inf counts of a 16-bit tensor are lower bounds.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from .graph_tap import GraphTapMismatch, StaticFingerprints
from .hooks import Tap
from .hooks.install import add_hooks
from .points import EMBED_OUT, in_norm, layer_out

__all__ = ["CompiledTaps", "ops"]

# slots id -> StaticFingerprints: the custom ops find their slots here (an op takes tensors and ints).
# Process-wide by nature: the ops are the process's; entries leave with `CompiledTaps.remove()`.
_SLOTS: dict = {}
_IDS = itertools.count(1)
_OPS: list = []


def ops():
    """(fp_into, fp_begin), defined once per process (torch.library refuses a second definition)."""
    if _OPS:
        return _OPS[0]

    @torch.library.custom_op("tpprobe::fp_into", mutates_args=("buf",))
    def fp_into(x: torch.Tensor, buf: torch.Tensor, sid: int, slot: int) -> None:
        slots = _SLOTS.get(sid)
        if slots is not None:            # None: removed, in a graph compiled before (nothing to fill)
            slots.fill(slot, x, buf)

    @fp_into.register_fake
    def _(x, buf, sid, slot):
        return None

    @torch.library.custom_op("tpprobe::fp_begin", mutates_args=("buf",))
    def fp_begin(buf: torch.Tensor, sid: int) -> None:
        slots = _SLOTS.get(sid)
        if slots is not None:
            slots.zero_flags(buf)

    @fp_begin.register_fake
    def _(buf, sid):
        return None

    _OPS.append((fp_into, fp_begin))
    return _OPS[0]


def _stream(output) -> Optional[torch.Tensor]:
    """The stream leaving a decoder layer (hidden + residual), traceable: no Python state."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        if len(output) > 1 and isinstance(output[1], torch.Tensor):
            return output[0] + output[1]
        return output[0]
    return None


def _first(output) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class CompiledTaps:
    """Static fingerprint slots filled from inside a compiled model's graph (see the module's doc)."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, *, seed: int = 0, k: int = 32,
                 embed: Optional[str] = None, layers: Optional[str] = None):
        fp_into, fp_begin = ops()
        self.model = model
        with torch.no_grad(), Tap(model, embed=embed, layers=layers, input_ids=ids, audit=False,
                                  keep=lambda n: False) as tap:
            model(ids)                   # where the embedding and the layers are (the Tap's discovery)
        if tap.embed_name is None or not tap.layer_indices:
            raise GraphTapMismatch("the embedding or the decoder layers were not found: nothing to tap")
        self.tap = tap                   # what was found (the record of a replay is made from it)
        mods = dict(model.named_modules())
        points = [(EMBED_OUT, mods[tap.embed_name], _first)]
        first = tap._layer_names[0] + ".input_layernorm"
        if first in mods:
            points.append((in_norm(tap.layer_indices[0]), mods[first], _first))
        points += [(layer_out(i), mods[n], _stream) for i, n in zip(tap.layer_indices, tap._layer_names)]
        self.slots = StaticFingerprints(ids.device, seed, k)
        self.sid = next(_IDS)
        _SLOTS[self.sid] = self.slots
        self.names: list[str] = []
        self.handles: list = []
        order: dict = {}

        def planner(name, read):        # the eager forward that lays out the slots, in call order
            def post(mod, args, output):
                t = read(output)
                if t is not None and name not in order:
                    order[name] = self.slots.add(t.contiguous())
            return post

        plan = [h for name, m, read in points for h in add_hooks(m, None, planner(name, read))]
        try:
            with torch.no_grad():
                model(ids)
        finally:
            for h in plan:
                h.remove()
        self.slots.freeze()
        self.names = sorted(order, key=order.get)
        buf, sid = self.slots.buf, self.sid
        torch._dynamo.mark_static_address(buf)
        first_name = self.names[0]
        for name, m, read in points:
            if name not in order:
                continue
            slot = order[name]

            def post(mod, args, output, slot=slot, read=read):
                t = read(output)
                fp_into(t.contiguous(), buf, sid, slot)

            pre = None
            if name == first_name:
                def pre(mod, args):
                    fp_begin(buf, sid)
            self.handles += add_hooks(m, pre, post)

    def read(self) -> dict:
        """{capture point: Fingerprint} of what the last forward or replay wrote (one D2H copy, a sync)."""
        fps = self.slots.read()
        return dict(zip(self.names, fps))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        _SLOTS.pop(self.sid, None)

    def __enter__(self) -> "CompiledTaps":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
