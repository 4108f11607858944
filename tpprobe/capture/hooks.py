"""Scoped hooks: what the probe sees during one forward on one rank.

`Tap(model, ...)` is a context manager. On enter it finds modules by class-name pattern
(default `VocabParallelEmbedding` and `*DecoderLayer`, so any model built like SGLang's works),
registers forward hooks, and wraps `torch.distributed.all_reduce` so that every all-reduce issued
during the forward is audited: its input (before; all-reduce is in place) and output (after), the
group size, and which module issued it. On exit every handle is removed and the wrapper undone, in
`finally`, also when the forward raises.

Capture points (names used everywhere in tpprobe):
  embed.local   the embedding's local, pre-reduce output (the input of the all-reduce it issues;
                equal to embed.out when it issues none)
  embed.out     the embedding module's output
  layer.K.out   the residual stream leaving decoder layer K (hidden_states + residual), which is
                what EAGLE-3 layer id K captures (SGLang-Llama convention; id -1 = embed.out)

`keep(name) -> bool` decides which points keep a tensor; the others are passed to `summarize`
(e.g. a fingerprint) so the Tap never holds more than it must. All tensors kept are copies.
"""
from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .progress import Progress


@dataclass
class HookHandle:
    kind: str                 # "embed" | "layer" | "module"
    name: str                 # qualified module name
    index: Optional[int]      # layer index for decoder layers
    handles: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __repr__(self) -> str:
        idx = "" if self.index is None else f"[{self.index}]"
        return f"<{self.kind}{idx} {self.name}>"


@dataclass
class AllReduceRecord:
    seq: int
    module: str                     # innermost hooked module running when it was issued
    source: Optional[str]           # row-parallel module whose output it reduced, if known
    layer: Optional[int]            # decoder layer index, None outside layers
    where: str                      # "embed" | "layer.K" | "other"
    shape: tuple
    dtype: str
    group_size: int
    op: str
    inp: Optional[torch.Tensor] = None     # copy of the input (kept points only)
    out: Optional[torch.Tensor] = None
    inp_summary: Any = None
    out_summary: Any = None
    seconds: float = 0.0

    def meta(self) -> dict:
        return {"seq": self.seq, "module": self.module, "source": self.source, "layer": self.layer,
                "where": self.where, "shape": list(self.shape), "dtype": self.dtype,
                "group_size": self.group_size, "op": self.op}


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)$")
_ROW_PATTERNS = ("*RowParallel*",)


def find_modules(model: torch.nn.Module, embed_pattern: str, layer_pattern: str):
    """(embedding (name, module) or None, [(index, name, module)] of decoder layers in order)."""
    embed, layers = None, []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if embed is None and fnmatch.fnmatchcase(cls, embed_pattern):
            embed = (name, m)
        elif fnmatch.fnmatchcase(cls, layer_pattern):
            hit = _LAYER_RE.search(name)
            layers.append((int(hit.group(1)) if hit else len(layers), name, m))
    layers.sort(key=lambda x: x[0])
    return embed, layers


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            if isinstance(y, torch.Tensor):
                return y
    return None


def residual_stream(output) -> Optional[torch.Tensor]:
    """The stream leaving a decoder layer: hidden_states + residual (SGLang's convention)."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        h = output[0]
        r = output[1] if len(output) > 1 and isinstance(output[1], torch.Tensor) else None
        return h.clone() if r is None else h + r
    return None


class DeviceStalled(RuntimeError):
    """The GPU did not complete an all-reduce within the deadline (a peer died or hung)."""


class Tap:
    def __init__(self, model: torch.nn.Module, *, embed_pattern: str = "VocabParallelEmbedding",
                 layer_pattern: str = "*DecoderLayer", keep: Callable[[str], bool] = lambda n: True,
                 summarize: Optional[Callable[[torch.Tensor], Any]] = None,
                 keep_allreduce_tensors: bool = True, audit: bool = True,
                 progress: Optional[Progress] = None, extensions: tuple = (),
                 device_lag: Optional[tuple[int, float]] = None):
        self.model = model
        self.embed_pattern, self.layer_pattern = embed_pattern, layer_pattern
        self.keep, self.summarize = keep, summarize
        self.keep_ar = keep_allreduce_tensors
        self.audit = audit
        self.progress = progress or Progress()
        self.captures: dict[str, torch.Tensor] = {}
        self.summaries: dict[str, Any] = {}
        self.order: list[str] = []                 # capture points in the order they fired
        self.after: dict[str, int] = {}            # point -> all-reduces issued before it
        self.allreduces: list[AllReduceRecord] = []
        self.progress.audit = self.allreduces
        self.handles: list[HookHandle] = []
        self.row_outputs: list[dict] = []          # row-parallel outputs and whether they were reduced
        self.embed_name: Optional[str] = None
        self.layer_indices: list[int] = []
        self._stack: list[tuple[str, str, Optional[int]]] = []   # (name, kind, layer index)
        self._orig = None
        # extensions(tap) -> handles with .remove(): model-specific capture that calls
        # tap.record_point (SGLang 0.5.23 keeps the residual stream outside the layer's output)
        self.extensions = tuple(extensions)
        self._ext_handles: list = []
        # (collectives, seconds): CUDA only. Before issuing an all-reduce the host lets the GPU run
        # at most `collectives` all-reduces behind it, waiting (polling an event) at most `seconds`.
        # NCCL never blocks the host, so without a bound a forward whose peer died keeps queueing
        # kernels behind the stuck collective until the launch queue is full and the host blocks
        # in a kernel launch for good (seen on 2 H200s); with it the forward raises DeviceStalled,
        # as a blocking backend's collective would, and the probe reports.
        self.device_lag = device_lag
        self.device_stalled = False
        self.stream_from_layer_output = True

    # -- install / remove -------------------------------------------------------------------
    def __enter__(self) -> "Tap":
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _install(self) -> None:
        embed, layers = find_modules(self.model, self.embed_pattern, self.layer_pattern)
        if embed is not None:
            self.embed_name = embed[0]
            self._hook(embed[1], HookHandle("embed", embed[0], None), self._embed_post)
        seen: set[int] = set()
        for idx, name, m in layers:
            self.layer_indices.append(idx)
            self._hook(m, HookHandle("layer", name, idx), self._layer_post)
            for sub_name, sub in m.named_modules():
                if sub is m or id(sub) in seen:   # a module shared by layers (SGLang's rope) once
                    continue
                seen.add(id(sub))
                kind = "row" if any(fnmatch.fnmatchcase(type(sub).__name__, p) for p in _ROW_PATTERNS) else "module"
                self._hook(sub, HookHandle(kind, f"{name}.{sub_name}", idx), self._module_post)
        for ext in self.extensions:
            self._ext_handles += list(ext(self) or [])
        if self.audit:
            self._orig = (dist.all_reduce, c10d.all_reduce)
            dist.all_reduce = self._all_reduce
            c10d.all_reduce = self._all_reduce

    def _hook(self, module, handle: HookHandle, post) -> None:
        def pre(mod, args):
            self._stack.append((handle.name, handle.kind, handle.index))
            if handle.kind == "layer":
                self.progress.set("forward", f"layer {handle.index}")

        def post_(mod, args, output):
            if self._stack and self._stack[-1][0] == handle.name:
                self._stack.pop()
            post(handle, args, output)

        # prepend: know where we are before any other pre-hook of the module runs (or hangs)
        handle.handles += [module.register_forward_pre_hook(pre, prepend=True), module.register_forward_hook(post_)]
        self.handles.append(handle)

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for h in self._ext_handles:
            h.remove()
        self._ext_handles = []
        if self._orig is not None:
            dist.all_reduce, c10d.all_reduce = self._orig
            self._orig = None

    # -- capture --------------------------------------------------------------------------
    def _record(self, name: str, t: Optional[torch.Tensor], copied: bool) -> None:
        if t is None:
            return
        self.after[name] = len(self.allreduces)
        self.order.append(name)
        if self.keep(name):
            self.captures[name] = t if copied else t.detach().clone()
        if self.summarize is not None:
            self.summaries[name] = self.summarize(t)

    def _embed_post(self, handle, args, output) -> None:
        out = _first_tensor(output)
        local = next((r for r in self.allreduces if r.where == "embed"), None)
        if local is None:  # no all-reduce ran inside the embedding: its local output is the output
            self._record("embed.local", out, copied=False)
        else:
            self.order.append("embed.local")
            self.after["embed.local"] = local.seq
            if local.inp is not None and self.keep("embed.local"):
                self.captures["embed.local"] = local.inp
            if self.summarize is not None and local.inp_summary is not None:
                self.summaries["embed.local"] = local.inp_summary
        self._record("embed.out", out, copied=False)

    def record_point(self, name: str, t: Optional[torch.Tensor], copied: bool = False) -> None:
        """For extensions: record a capture point (copied=False makes the Tap clone it)."""
        self._record(name, t, copied=copied)

    def _layer_post(self, handle, args, output) -> None:
        name = f"layer.{handle.index}.out"
        if not self.stream_from_layer_output:
            return
        if self.summarize is None and not self.keep(name):
            self.order.append(name)       # nothing to keep: do not even form hidden + residual
            self.after[name] = len(self.allreduces)
            return
        self._record(name, residual_stream(output), copied=True)

    def _module_post(self, handle, args, output) -> None:
        if handle.kind != "row":
            if handle.name.endswith(".input_layernorm") and self.layer_indices and handle.index == self.layer_indices[0]:
                # a candidate for "the embedding slot was taken after a transform"
                self._record(f"layer.{handle.index}.in_norm", _first_tensor(output), copied=False)
            return
        out = _first_tensor(output)
        reduced_inside = any(r.source == handle.name for r in self.allreduces)
        self.row_outputs.append({"module": handle.name, "layer": handle.index,
                                 "ptr": out.data_ptr() if out is not None else None,
                                 "reduced": reduced_inside})

    # -- all-reduce audit -----------------------------------------------------------------
    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        orig = self._orig[0]
        if not isinstance(tensor, torch.Tensor):
            return orig(tensor, op=op, group=group, async_op=async_op)
        seq = len(self.allreduces)
        if self.device_lag is not None and tensor.is_cuda:
            self._bound_lag()
        module, layer, where, source = self._attribution(tensor)
        rec = AllReduceRecord(seq=seq, module=module, source=source, layer=layer, where=where,
                              shape=tuple(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""),
                              group_size=dist.get_world_size(group), op=str(op).split(".")[-1])
        keep = self.keep_ar or where == "embed"
        if keep:
            rec.inp = tensor.detach().clone()
        if self.summarize is not None:
            rec.inp_summary = self.summarize(tensor)
        self.allreduces.append(rec)
        self.progress.collective = {"seq": seq, "module": module, "where": where,
                                    "shape": list(rec.shape), "since": time.time()}
        t0 = time.perf_counter()
        work = orig(tensor, op=op, group=group, async_op=async_op)
        if async_op and work is not None:
            work.wait()
        if tensor.is_cuda:        # completes when the collective does (wait() ordered the stream)
            ev = torch.cuda.Event()
            ev.record()
            self.progress.events.append((seq, ev))
        rec.seconds = time.perf_counter() - t0
        self.progress.collective = None
        if keep:
            rec.out = tensor.detach().clone()
        if self.summarize is not None:
            rec.out_summary = self.summarize(tensor)
        return work

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
        module = self._stack[-1][0] if self._stack else "<outside hooked modules>"
        layer = next((idx for _, kind, idx in reversed(self._stack) if kind == "layer"), None)
        in_embed = any(kind == "embed" for _, kind, _ in self._stack)
        where = "embed" if in_embed else (f"layer.{layer}" if layer is not None else "other")
        source = next((name for name, kind, _ in reversed(self._stack) if kind == "row"), None)
        if source is None:  # reduced after the row-parallel module returned (reduce_results=False)
            ptr = tensor.data_ptr()
            for row in reversed(self.row_outputs):
                if row["ptr"] == ptr and not row["reduced"]:
                    row["reduced"], source = True, row["module"]
                    if not in_embed and row["layer"] is not None:
                        layer, where = row["layer"], f"layer.{row['layer']}"
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
