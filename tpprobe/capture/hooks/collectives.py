"""The Tap's side of the collective audit: where a collective runs in the model, the device-lag bound, cuts."""
from __future__ import annotations

import sys
import time
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...core.cuda import current_stream
from ..audit import CollectiveRecord
from ..points import AR_OUT, EMBED_LOCAL, EMBED_PLACE, layer_place, parse

# Every module call runs inside torch.nn.Module._call_impl (its forward, and its pre- and forward
# hooks): the frames of that function on this thread, each with its `self`, are the modules being
# called, innermost first. The collective audit reads them when a collective is issued (rarely:
# a few per layer) instead of every module keeping a stack with hooks on every call.
_CALL_IMPL = getattr(torch.nn.Module._call_impl, "__code__", None)


def running_modules(known: dict, frame=None, limit: int = 1000) -> list:
    """known[id(module)] = (name, kind, layer index) for every module of ``known`` whose call is
    running on this thread, innermost first (read from the Python frames of
    torch.nn.Module._call_impl), up to the first decoder layer: ``known`` holds the layers and the
    modules inside them, so nothing known runs around a layer."""
    out = []
    f = frame if frame is not None else sys._getframe(1)
    code = _CALL_IMPL
    while f is not None and limit:
        if f.f_code is code:
            e = known.get(id(f.f_locals.get("self")))
            if e is not None:
                out.append(e)
                if e[1] == "layer":
                    break
        f = f.f_back
        limit -= 1
    return out


# process-wide by nature: a pure function of the layer index (points.layer_place), made once per index
_PLACES: dict = {}


def _place(layer: Optional[int]) -> str:
    p = _PLACES.get(layer)
    if p is None:
        p = _PLACES[layer] = layer_place(layer)
    return p


_Event = getattr(torch._C, "_CudaEventBase", None)
if not hasattr(_Event, "record"):           # a CPU build's stub
    _Event = torch.cuda.Event
_record = getattr(_Event, "record", None)   # None: a stub without one (vLLM's CPU worker swaps torch.cuda.Event
#                                            for a placeholder); only CUDA tensors record events


class DeviceStalled(RuntimeError):
    """The GPU did not complete an all-reduce within the deadline (a peer died or hung)."""


class Collectives:
    """The Tap's methods the audit calls (attribution, copies, the device-lag bound) and the cuts
    made after a peer died.  Mixed into `Tap`: reads its state."""

    def collective(self, kind: str, path: str, inp, group_size: int, op: str = "SUM"):
        """Record one collective issued by a wrapper above c10d (see capture/audit/wrappers.py)."""
        return self.auditor.collective(kind, path, inp, group_size, op)

    def _audit_copy(self, name: str, t: torch.Tensor, where: str) -> Optional[torch.Tensor]:
        if where == EMBED_PLACE and not self.keep_ar:
            if parse(name).kind == AR_OUT:   # admitted with its input (embed.local): both or neither
                return self._copy(t)
            name = EMBED_LOCAL
        return self._copy(t) if self._admitted(name, t) else None

    def _before_collective(self, inp) -> None:
        if self.device_lag is not None and isinstance(inp, torch.Tensor) and inp.is_cuda:
            self._bound_lag()

    def _after_collective(self, rec: CollectiveRecord, out) -> None:
        t = out if isinstance(out, torch.Tensor) else None
        if t is not None and t.is_cuda:    # completes when the collective does (wait() ordered the stream)
            # torch.cuda.Event's base, recorded on the kept Stream: the Python subclass's __new__
            # and record() (which looks the stream up again) are two more frames per collective
            ev = _Event()
            _record(ev, current_stream(t.get_device()))
            self.progress.events.append((rec.seq, ev))

    def _arm_native(self) -> None:
        """allreduce's door in C, where built (capture/audit/doors.py), records this Tap's all-reduces as
        the audit and `_after_collective` would: armed only where `_after_collective` is this one."""
        if type(self)._after_collective is Collectives._after_collective:
            self.auditor.arm(_Event, _record, current_stream)

    def _bound_lag(self) -> None:
        lag, limit = self.device_lag
        ev = self.progress.events
        if len(ev) < lag or ev[-lag][1].query():
            return
        seq, e = ev[-lag]
        t_end = time.time() + limit
        while not e.query():
            if time.time() > t_end:
                self.device_stalled = True
                raise DeviceStalled(f"all-reduce #{seq + 1 if seq + 1 < len(self.allreduces) else seq} did not "
                                    f"complete on the GPU within {limit:g}s")
            time.sleep(0.0001)

    def _attribution(self, tensor):
        # the modules running this collective, innermost first, read from the frames of
        # torch.nn.Module._call_impl as running_modules reads them: the innermost known module names
        # it, the first row-parallel one is its source, the first layer its place; the embedding's
        # (its hooks keep a stack: it is known only once it consumed the ids). A row-parallel module
        # of the layer the layer hooks say is running ends the walk: the first layer above it is that
        # one. One shared by layers, or called outside its own layer, names another layer than the
        # running one (or there is none): then the walk goes on to the layer's own frame
        known, code, now = self._known, _CALL_IMPL, self._layer_now
        module = source = layer = None
        row = self._row_now
        if row is not None and now is not None and row[1] == now:
            # a leaf row-parallel module of the running layer is running (its hooks say so): the walk
            # would end at its frame with the same three names
            module = source = row[0]
            layer = now
            f = None
        else:
            f = sys._getframe(1)
        limit = 1000
        while f is not None and limit:
            if f.f_code is code:
                e = known.get(id(f.f_locals.get("self")))
                if e is not None:
                    if module is None:
                        module = e[0]
                    kind = e[1]
                    if kind == "layer":
                        layer = e[2]
                        break
                    if kind == "row" and source is None:
                        source = e[0]
                        if now is not None and e[2] == now:
                            layer = now
                            break
            f = f.f_back
            limit -= 1
        in_embed = bool(self._stack)
        if module is None:
            module = self._stack[-1][0] if in_embed else "<outside hooked modules>"
        where = _place(-1 if in_embed else layer)
        if source is None and isinstance(tensor, torch.Tensor):
            # reduced after the row-parallel module returned (reduce_results=False)
            ptr, storage = tensor.data_ptr(), None
            for row in reversed(self.row_outputs):
                if row["ptr"] == ptr and not row["reduced"]:
                    storage = storage or StorageWeakRef(tensor.untyped_storage())
                    if row["storage"] is None or row["storage"].expired() or row["storage"] != storage:
                        continue
                    row["reduced"], source = True, row["module"]
                    if not in_embed and row["layer"] is not None:
                        layer, where = row["layer"], _place(row["layer"])
                    break
        return module, layer, where, source

    def truncate_to_device(self, done: int) -> None:
        """The device completed all-reduces up to #done and no further (a peer died or hung; the
        communicator was aborted): keep what a blocking backend would have, the captures taken
        before #done + 1 and its input, and drop what was computed from its unfinished output."""
        cut = done + 1
        for name in [n for n, k in self.after.items() if k > cut]:
            self.captures.pop(name, None)
            self.summaries.pop(name, None)
        self.order = [n for n in self.order if self.after.get(n, 0) <= cut]
        del self.allreduces[cut + 1:]
        if len(self.allreduces) > cut:
            self.allreduces[cut].out = self.allreduces[cut].out_summary = None

    def unreduced_rows(self) -> list[dict]:
        return [{"module": r["module"], "layer": r["layer"]} for r in self.row_outputs if not r["reduced"]]
