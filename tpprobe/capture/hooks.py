"""Scoped hooks: what the probe sees during one forward on one rank.

`Tap(model, ...)` is a context manager. On enter it finds the decoder layers and the embedding
from the model's structure (capture/discover.py: the longest ModuleList; the module that consumes
the input ids and emits [tokens, hidden]), or from overrides (`embed=`, `layers=`: a module path
or a class-name glob), hooks the modules whose calls it reads (the decoder layers, row-parallel
modules, layer 0's input norm, the embedding; a wrapper around the forward instead of hooks where
a module has no other hook, so its call stays on torch's fast path), and starts the collective audit
(capture/audit.py: every all-reduce, reduce-scatter and all-gather at the c10d dispatcher level,
whatever door it came through): its input (before) and output (after), the group size, the path
and which module issued it (read when it is issued from the frames of the module calls running
then: `running_modules`; no module keeps a stack for it). On exit every handle is removed and
the audit stopped, also when the forward raises. `coverage()` says what was hooked and audited.

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

import sys
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from ..core.cuda import current_stream
from . import discover
from .audit import Audit, CollectiveRecord, holds_inference_tensors
from .params import dtensor_placements
from .points import (AR_OUT, EMBED_LOCAL, EMBED_OUT, EMBED_PLACE, IN_NORM, SHARE, STREAM, in_norm, layer_out,
                     layer_place, parse)
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


class _Pair:
    """A pre-hook and/or a forward hook written straight into one module's hook dicts, as torch's
    ``register_forward_pre_hook(prepend=True)`` / ``register_forward_hook`` write them, with ids
    from the same counter; ``remove()`` takes them out. The Tap installs its hooks for every
    forward: through torch's API (a RemovableHandle each, with weak references) a hook cost ~1.3 us
    to add and remove, 100 us per forward on the 4-layer built-in model; this costs ~0.15 us."""
    __slots__ = ("module", "pre_id", "post_id")

    def __init__(self, module, pre, post, with_kwargs: bool):
        i = RemovableHandle.next_id
        RemovableHandle.next_id = i + 2
        self.module, self.pre_id, self.post_id = module, (i if pre is not None else None), \
            (i + 1 if post is not None else None)
        if pre is not None:
            d = module._forward_pre_hooks
            d[i] = pre
            d.move_to_end(i, last=False)        # first: know where we are before any other pre-hook
            if with_kwargs:
                module._forward_pre_hooks_with_kwargs[i] = True
        if post is not None:
            module._forward_hooks[i + 1] = post
            if with_kwargs:
                module._forward_hooks_with_kwargs[i + 1] = True

    def remove(self) -> None:
        m = self.module
        if m is None:
            return
        self.module = None
        if self.pre_id is not None:
            m._forward_pre_hooks.pop(self.pre_id, None)
            m._forward_pre_hooks_with_kwargs.pop(self.pre_id, None)
        if self.post_id is not None:
            m._forward_hooks.pop(self.post_id, None)
            m._forward_hooks_with_kwargs.pop(self.post_id, None)


_DIRECT = all(hasattr(torch.nn.Linear(1, 1), a) for a in (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs"))


_NO_FORWARD = object()


class _Wrap:
    """pre and post around the module's own forward, as an instance attribute ``forward``: for a
    module with no hooks at all, so that its call keeps torch's fast path (a module with any hook
    takes ``_call_impl``'s slow path: ~4 us a call here, ~10 on a GPU host, per hooked module per
    forward). Equivalent to a first pre-hook and a last forward hook only while the module has no
    other hooks, which is why it is used only then (``add_hooks``). ``remove()`` puts back what
    was there."""
    __slots__ = ("module", "prev")

    def __init__(self, module, pre, post):
        d = module.__dict__
        self.module, self.prev = module, d.get("forward", _NO_FORWARD)
        inner = module.forward
        if pre is None:
            def forward(*args, **kwargs):
                out = inner(*args, **kwargs)
                post(module, args, out)
                return out
        else:
            def forward(*args, **kwargs):
                pre(module, args)
                out = inner(*args, **kwargs)
                post(module, args, out)
                return out
        forward.__wrapped__ = inner          # inspect.signature(module.forward) still reads the model's
        d["forward"] = forward

    def remove(self) -> None:
        m = self.module
        if m is None:
            return
        self.module = None
        if self.prev is _NO_FORWARD:
            m.__dict__.pop("forward", None)
        else:
            m.__dict__["forward"] = self.prev


def _hookless(module) -> bool:
    """No hook of any kind on the module nor global ones: a wrapper is then the same as hooks."""
    mm = torch.nn.modules.module
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or mm._global_forward_hooks or mm._global_forward_pre_hooks
                or mm._global_backward_hooks or mm._global_backward_pre_hooks)


def add_hooks(module: torch.nn.Module, pre, post, with_kwargs: bool = False, wrap: bool = False) -> list:
    """pre (first of the module's pre-hooks) and post (last of its forward hooks), either may be
    None: handles with ``remove()``. wrap=True (post given, no kwargs): around the module's forward
    instead (``_Wrap``) when the module has no other hook. Through torch's own registration where
    its hook dicts are not as expected."""
    if _DIRECT and isinstance(getattr(module, "_forward_pre_hooks", None), OrderedDict):
        if wrap and post is not None and not with_kwargs and _hookless(module):
            return [_Wrap(module, pre, post)]
        return [_Pair(module, pre, post, with_kwargs)]
    return ([module.register_forward_pre_hook(pre, prepend=True, with_kwargs=with_kwargs)] if pre else []) + \
        ([module.register_forward_hook(post, with_kwargs=with_kwargs)] if post else [])


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


def _local(t):
    """A DTensor's local tensor (no collective), any other tensor as it is."""
    return t.to_local() if dtensor_placements(t) is not None else t


_ROW_KINDS = (STREAM, SHARE, IN_NORM)    # capture points held as [tokens, hidden] (discover.rows)
AllReduceRecord = CollectiveRecord        # the name earlier code imports
_ROW_PATTERNS = discover.ROW_PATTERNS        # the name earlier code imports


def find_modules(model: torch.nn.Module, embed: Optional[str] = None, layers: Optional[str] = None):
    """(embedding (name, module) or None when it is found during the forward, [(index, name, module)]
    of decoder layers in order). See capture/discover.py."""
    _, _, found = discover.layer_list(model, layers)
    return (discover.embedding(model, embed) if embed else None), found


def first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            if isinstance(y, torch.Tensor):
                return y
    return None


def is_owed(output) -> bool:
    """SGLang 0.5.23's OwedOutput (a decoder layer's partial sum the next boundary reduces)."""
    return type(output).__name__ in ("OwedOutput", "UnreducedOutput")


def residual_stream(output) -> Optional[torch.Tensor]:
    """The stream leaving a decoder layer: hidden_states + residual (SGLang's convention)."""
    if is_owed(output):
        return None
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        h = output[0]
        r = output[1] if len(output) > 1 and isinstance(output[1], torch.Tensor) else None
        return h.clone() if r is None else h + r
    return None


_Event = getattr(torch._C, "_CudaEventBase", None)
if not hasattr(_Event, "record"):           # a CPU build's stub
    _Event = torch.cuda.Event
_record = getattr(_Event, "record", None)   # None: a stub without one (vLLM's CPU worker swaps torch.cuda.Event
#                                            for a placeholder); only CUDA tensors record events


class DeviceStalled(RuntimeError):
    """The GPU did not complete an all-reduce within the deadline (a peer died or hung)."""


class _Plan:
    """What `_install` finds from a model's structure, kept per model object (weakly) so a Tap per
    forward does not walk `named_modules` again (on the built-in model, 4 layers: the walks were half
    of the 270 us an install took). Used again while the model's structure is unchanged: no module,
    parameter or buffer was registered anywhere since (PyTorch's global registration hooks count
    them: assignment, add_module, ModuleList.append) and no module has a different number of
    children, parameters and buffers (a deletion). Not seen: `_modules` edited by hand, a parameter's
    `.data` replaced."""
    __slots__ = ("layer_how", "layer_list", "layers", "embed", "candidates", "subs", "known", "inference", "stamp",
                 "mods", "found", "cached")


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GEN = [0]


def _bump(*_):
    _GEN[0] += 1


for _reg in ("register_module_module_registration_hook", "register_module_parameter_registration_hook",
             "register_module_buffer_registration_hook"):
    getattr(torch.nn.modules.module, _reg)(_bump)


def _plan(model: torch.nn.Module, layer_spec: Optional[str], embed_spec: Optional[str]) -> _Plan:
    try:
        per = _PLANS.setdefault(model, {})
    except TypeError:               # not weakly referenceable: no cache
        per = {}
    plan = per.get((layer_spec, embed_spec))
    if plan is not None and plan.stamp == _stamp(model, plan.mods):
        return _root(plan, model)
    plan = _Plan()
    plan.found = None        # the candidate an earlier Tap found to be the embedding (its name)
    plan.cached = plan
    plan.layer_how, plan.layer_list, plan.layers = discover.layer_list(model, layer_spec)
    plan.embed = discover.embedding(model, embed_spec) if embed_spec else None
    plan.candidates = [] if embed_spec else discover.candidates(model, plan.layers, plan.layer_list)
    seen: set[int] = set()
    plan.subs = []
    for idx, name, m in plan.layers:
        subs = []
        for sub_name, sub in m.named_modules():
            if sub is m or id(sub) in seen:   # a module shared by layers (SGLang's rope) once
                continue
            seen.add(id(sub))
            kind = "row" if discover.is_row_parallel(sub) else "module"
            subs.append((kind, f"{name}.{sub_name}", sub))
        plan.subs.append((idx, name, m, subs))
    # what the collective audit names from the running module calls: the layers and every module
    # inside them (ids: the plan is used only while these modules are all alive, see _stamp)
    plan.known = {}
    for idx, name, m, subs in plan.subs:
        plan.known[id(m)] = (name, "layer", idx)
        for kind, sub_name, sub in subs:
            plan.known[id(sub)] = (sub_name, kind, idx)
    plan.inference = holds_inference_tensors(model)
    # the cache holds no reference to the model itself (it is the weak key): None stands for it
    plan.mods = [m for m in model.modules() if m is not model]
    plan.stamp = _stamp(model, plan.mods)
    plan.candidates = [(n, None if m is model else m) for n, m in plan.candidates]
    plan.embed = None if plan.embed is None else (plan.embed[0], None if plan.embed[1] is model else plan.embed[1])
    per[(layer_spec, embed_spec)] = plan
    return _root(plan, model)


def _stamp(model, mods) -> tuple:
    return _GEN[0], len(model._modules) + len(model._parameters) + len(model._buffers), \
        tuple([len(m._modules) + len(m._parameters) + len(m._buffers) for m in mods])


def _root(plan: _Plan, model) -> _Plan:
    """The plan with the model itself put back where the cache holds None."""
    out = _Plan()
    for k in _Plan.__slots__:
        setattr(out, k, getattr(plan, k))
    out.candidates = [(n, model if m is None else m) for n, m in plan.candidates]
    if plan.embed is not None and plan.embed[1] is None:
        out.embed = (plan.embed[0], model)
    return out


# layer families that need model-specific extensions: module prefix -> () -> extensions. Filled by
# the family's own package when it is imported (tpprobe.engines.sglang.stream: "sglang."), so the Tap
# never imports a model family itself.
LAYER_EXTENSIONS: dict = {}


class Tap:
    def __init__(self, model: torch.nn.Module, *, embed: Optional[str] = None, layers: Optional[str] = None,
                 input_ids: Optional[torch.Tensor] = None, keep: Callable[[str], bool] = lambda n: True,
                 summarize: Optional[Callable[[torch.Tensor], Any]] = None,
                 keep_allreduce_tensors: bool = True, audit: bool = True,
                 progress: Optional[Progress] = None, extensions: tuple = (),
                 admit: Optional[Callable[[str, torch.Tensor], bool]] = None,
                 sample_rows: Optional[int] = None,
                 device_lag: Optional[tuple[int, float]] = None):
        self.model = model
        self.embed_spec, self.layer_spec, self.input_ids = embed, layers, input_ids
        # the ranks a sequence-parallel stream is split over (Megatron): the default group's
        self._world = (torch.distributed.get_world_size() if torch.distributed.is_available()
                       and torch.distributed.is_initialized() else 1)
        self._seq_shards: dict[str, torch.Tensor] = {}   # point -> this rank's sequence chunk
        # admit(name, tensor): asked BEFORE a kept point is copied (a byte budget); sample_rows:
        # keep only the first rows of each kept tensor (both: the SGLang plugin's bounded memory)
        self.admit, self.sample_rows = admit, sample_rows
        self.keep, self.summarize = keep, summarize
        self.keep_ar = keep_allreduce_tensors
        self.audit = audit
        self.progress = progress or Progress()
        self.captures: dict[str, torch.Tensor] = {}
        self.summaries: dict[str, Any] = {}
        self.order: list[str] = []                 # capture points in the order they fired
        self.after: dict[str, int] = {}            # point -> collectives issued before it
        self.auditor = Audit(self._attribution,
                             keep=lambda where: self.keep_ar or (where == EMBED_PLACE and self.keep(EMBED_LOCAL)),
                             summarize=summarize, progress=self.progress, copy=self._audit_copy,
                             before=self._before_collective, after=self._after_collective)
        self.allreduces: list[CollectiveRecord] = self.auditor.records
        self.progress.audit = self.allreduces
        self.layer_how, self.layer_list, self.embed_how = "", "", ""
        self.layers_ran: set = set()
        self._embed_pending: list = []             # (name, ids) of the candidates running, outermost first
        self._embed_fallback = None                # an inner candidate that emitted rows
        self.embed_layout: Optional[str] = None    # discover.BSH | SBH | TH: how the stream holds tokens
        self._ids_shape: Optional[tuple] = None
        self.placements: dict[str, list] = {}      # capture point -> a DTensor's placements
        self.row_placements: dict[str, list] = {}  # row-parallel module -> its DTensor output's placements
        self.raised_in: Optional[str] = None       # where the model's forward raised: "layer K (module)"
        self.unreadable: dict[str, str] = {}       # capture point -> why tpprobe could not read it
        self._layer_names: list[str] = []
        self.handles: list[HookHandle] = []
        self.row_outputs: list[dict] = []          # row-parallel outputs and whether they were reduced
        self.embed_name: Optional[str] = None
        self.layer_indices: list[int] = []
        self._stack: list[tuple[str, str, Optional[int]]] = []   # the embedding while it runs
        self._known: dict = {}
        self._plan_cache = None                    # the cached plan (its `found` embedding)
        self._auditing = False
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
        if device_lag is None:
            self.auditor.before = None             # nothing to bound: no call per collective
        self.device_stalled = False
        self.stream_from_layer_output = True
        self.sglang_layers = False                 # SGLang's layers: the stream comes from its boundaries

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
        if self._seq_shards and exc[0] is None:
            self._gather_sequence_shards()

    def _gather_sequence_shards(self) -> None:
        """Sequence parallelism (Megatron's; torch's SequenceParallel, Shard(1)): between the reduce-scatter
        and the all-gather each rank holds its chunk of the sequence; a stream point read there is gathered
        here, once the forward is over and the audit stopped (so none of these gathers is counted as the
        model's), into the full
        [tokens, hidden] every rank must hold alike. Only after a forward that ran every layer: a
        forward that stopped early (a peer died) has no chunk to gather on some rank."""
        shards, self._seq_shards = self._seq_shards, {}
        if len(self.layers_ran) < len(self.layer_indices):
            return
        dist = torch.distributed
        for name, t in shards.items():
            full = torch.empty((t.shape[0] * self._world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(full, t.contiguous())
            if self.embed_layout == discover.BSH_SP:     # [world * b, s / world, h] -> [b, s, h], rank-major
                b, chunk = t.shape[0], t.shape[1]
                full = full.view(self._world, b, chunk, -1).transpose(0, 1).reshape(b, chunk * self._world, -1)
                full = discover.rows(full, discover.BSH, self._ids_shape)
            else:
                full = discover.rows(full, discover.SBH, self._ids_shape)
            if self.keep(name) and self._admitted(name, full):
                self.captures[name] = full
            if self.summarize is not None:
                self.summaries[name] = self.summarize(full)

    def _install(self) -> None:
        plan = _plan(self.model, self.layer_spec, self.embed_spec)
        self.layer_how, self.layer_list, layers = plan.layer_how, plan.layer_list, plan.layers
        self._layer_names = [n for _, n, _ in layers]
        if self.embed_spec:
            name, m = plan.embed
            self.embed_name, self.embed_how = name, "override"
            self._hook(m, HookHandle("embed", name, None), self._embed_post)
        else:     # found during the forward: the module that consumes the ids and emits [tokens, hidden]
            # once a Tap found it, the next Taps of this model watch only that module (it is found
            # again the same way); one that does not find it there sends the next back to them all
            self._plan_cache = plan.cached
            watch = [(n, m) for n, m in plan.candidates if n == plan.found] or plan.candidates
            for name, m in watch:
                self._watch_embedding(name, m)
        self._known = plan.known
        first = plan.subs[0][0] if plan.subs else None
        for idx, name, m, subs in plan.subs:
            self.layer_indices.append(idx)
            self._hook(m, HookHandle("layer", name, idx), self._layer_post)
            for kind, sub_name, sub in subs:
                # row-parallel outputs are noted; layer 0's input norm is a capture point (a
                # candidate for "the embedding slot was taken after a transform"); the other
                # modules need no hook: a collective finds the modules it runs in from the frames
                post = (self._row_post if kind == "row" else
                        self._in_norm_post if idx == first and sub_name.endswith(".input_layernorm") else None)
                if post is not None:
                    self._hook(sub, HookHandle(kind, sub_name, idx), post)
        for prefix, factory in LAYER_EXTENSIONS.items():
            if any(type(m).__module__.startswith(prefix) for _, _, m in layers):
                # e.g. SGLang's own decoder layers (a user's --model factory too): their output is an
                # owed partial sum, so the stream is read where SGLang materializes it, and the reduces
                # at GroupCoordinator level (tpprobe.engines.sglang.stream registers itself here)
                self.extensions += tuple(e for e in factory() if e not in self.extensions)
                # vLLM's layers return (hidden_states, residual): the stream is read from them
                self.sglang_layers = self.sglang_layers or prefix == "sglang."
        for ext in self.extensions:
            self._ext_handles += list(ext(self) or [])
        if self.audit:
            # a model holding inference tensors: collectives on them bypass the audit's
            # ADInplaceOrView kernels, so the audit watches through its dispatch mode (capture/audit.py)
            self.auditor.use_mode = self.auditor.use_mode or plan.inference
            self.auditor.__enter__()
            self._auditing = True

    def _watch_embedding(self, name: str, module) -> None:
        """Pre/post hooks on a module that may be the embedding: the outermost one that consumes the
        input ids and emits one hidden row per token (any layout: discover.hidden_layout) is it; when
        the outermost consumer does not, the last inner one that did (kept while the outer runs)."""
        handle = HookHandle("embed", name, None)

        def pre(mod, args, kwargs):
            if self.embed_name is not None:
                return
            ids = discover.consumes_ids(args, kwargs, self.input_ids)
            if ids is not None:
                self._embed_pending.append((name, ids))
                self._stack.append((name, "embed", None))

        def post(mod, args, kwargs, output):
            if not self._embed_pending or self._embed_pending[-1][0] != name:
                return
            _, ids = self._embed_pending.pop()
            if self._stack and self._stack[-1][0] == name:
                self._stack.pop()
            layout = discover.hidden_layout(output, ids, self._world)
            if self._embed_pending:           # inside an outer consumer: a fallback, if it emits rows
                if layout is not None:
                    out = _local(first_tensor(output))      # kept as this rank's tensor: no DTensor op
                    self._embed_fallback = (name, handle, args, out.detach().clone(), layout, tuple(ids.shape))
                return
            fallback, self._embed_fallback = self._embed_fallback, None
            if layout is not None:
                self._embed_found(name, handle, args, output, layout, tuple(ids.shape))
            elif fallback is not None:
                self._embed_found(*fallback)
            else:                       # not the embedding: what it issued was not the embedding's
                for r in self.allreduces:
                    if r.where == EMBED_PLACE:
                        r.where = "other"

        handle.handles += add_hooks(module, pre, post, with_kwargs=True)
        self.handles.append(handle)

    def _embed_found(self, name, handle, args, output, layout, ids_shape) -> None:
        self.embed_name, self.embed_how = name, "structure"
        self.embed_layout, self._ids_shape = layout, ids_shape
        if self._plan_cache is not None:
            self._plan_cache.found = name
        self._embed_post(handle, args, output)

    def _hook(self, module, handle: HookHandle, post) -> None:
        """A decoder layer: pre says where the forward is (the watchdog's heartbeat), post reads its
        output; another module: post only. ``post(handle, args, output)``."""
        if handle.kind == "layer":
            progress, where = self.progress, f"layer {handle.index}"

            def pre(mod, args):
                progress.set("forward", where)
        else:
            pre = None

        def post_(mod, args, output):
            post(handle, args, output)

        handle.handles += add_hooks(module, pre, post_, wrap=True)
        self.handles.append(handle)

    def _remove(self) -> None:
        if self._plan_cache is not None and self.embed_name is None and self.layers_ran:
            self._plan_cache.found = None     # a forward ran and the watched module was not it
        for h in self.handles:
            h.remove()
        self.handles = []
        for h in self._ext_handles:
            h.remove()
        self._ext_handles = []
        if self._auditing:
            self._auditing = False
            self.auditor.__exit__(None, None, None)

    # -- capture --------------------------------------------------------------------------
    def _record(self, name: str, t: Optional[torch.Tensor], copied: bool) -> None:
        if t is None:
            return
        t = self._readable(name, t)
        if t is None:
            return
        if self.embed_layout is not None and parse(name).kind in _ROW_KINDS:
            if discover.is_sequence_shard(t, self.embed_layout, self._ids_shape, self._world):
                self.after[name] = len(self.allreduces)
                self.order.append(name)
                self._seq_shards[name] = t.detach().clone()     # gathered after the forward
                return
            t = discover.rows(t, self.embed_layout, self._ids_shape)
        self.after[name] = len(self.allreduces)
        self.order.append(name)
        if self.keep(name) and self._admitted(name, t):
            self.captures[name] = self._copy(t, copied)
        if self.summarize is not None:
            self.summaries[name] = self.summarize(t)

    def _readable(self, name: str, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A DTensor as this rank's local tensor, its placements recorded (a Partial one owes a
        reduce: checks name it); a tensor tpprobe cannot read (no storage) named, never fatal."""
        placements = dtensor_placements(t)
        if placements is not None:
            self.placements[name] = list(placements)
            try:
                t = t.to_local()
            except Exception as e:
                self.unreadable[name] = f"{type(t).__name__}: {type(e).__name__}: {e}"[:200]
                return None
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            try:                       # a subclass: read it once here, where a failure is named
                t = t.detach().clone()
                t.data_ptr()
            except Exception as e:     # a tensor subclass with no readable storage
                self.unreadable[name] = f"{type(t).__name__}: {type(e).__name__}: {e}"[:200]
                return None
        return t

    def _admitted(self, name: str, t: torch.Tensor) -> bool:
        return self.admit is None or self.admit(name, t)

    def _copy(self, t: torch.Tensor, copied: bool = False) -> torch.Tensor:
        if self.sample_rows is not None and t.dim() and t.shape[0] > self.sample_rows:
            return t.detach()[:self.sample_rows].clone()
        return t if copied else t.detach().clone()

    def _embed_post(self, handle, args, output) -> None:
        out = first_tensor(output)
        local = next((r for r in self.allreduces if r.where == EMBED_PLACE), None)
        if local is None:  # no all-reduce ran inside the embedding: its local output is the output
            self._record(EMBED_LOCAL, out, copied=False)
        else:
            self.order.append(EMBED_LOCAL)
            self.after[EMBED_LOCAL] = local.seq
            if local.inp is not None and self.keep(EMBED_LOCAL):
                inp, ids = local.inp, self._ids_shape
                if self.embed_layout == discover.BSH_SP and inp.dim() == 3 and ids is not None and len(ids) == 2 \
                        and tuple(inp.shape[:2]) == (self._world * ids[0], ids[1] // self._world):
                    # funcol's reduce_scatter_tensor to Shard(1) cats the dim-1 chunks along dim 0 before
                    # it scatters: this rank's whole partial sum, back in [b, s, h]
                    inp = inp.view(self._world, ids[0], ids[1] // self._world, -1).transpose(0, 1) \
                        .reshape(ids[0], ids[1], -1)
                self.captures[EMBED_LOCAL] = discover.rows(inp, self.embed_layout, self._ids_shape)
            if self.summarize is not None and local.inp_summary is not None \
                    and not isinstance(local.inp_summary, (list, tuple)):   # a reduce-scatter's: one per chunk
                self.summaries[EMBED_LOCAL] = local.inp_summary
        self._record(EMBED_OUT, out, copied=False)

    def record_point(self, name: str, t: Optional[torch.Tensor], copied: bool = False) -> None:
        """For extensions: record a capture point (copied=False makes the Tap clone it)."""
        self._record(name, t, copied=copied)

    def _layer_post(self, handle, args, output) -> None:
        name = layer_out(handle.index)
        self.layers_ran.add(handle.index)
        if not self.stream_from_layer_output or self.sglang_layers or is_owed(output):
            return     # an owed output (SGLang's OwedOutput) is a handle, never a tensor to read
        if self.summarize is None and not self.keep(name):
            self.order.append(name)       # nothing to keep: do not even form hidden + residual
            self.after[name] = len(self.allreduces)
            return
        self._record(name, residual_stream(self._local_output(name, output)), copied=True)

    def _local_output(self, name: str, output):
        """A layer's output with DTensors replaced by their local tensors, placements recorded: any op
        on a DTensor (even the clone that reads the stream) may redistribute it, a collective of the
        probe's own inside the model's forward (a Partial one would be reduced and read as healthy)."""
        if isinstance(output, torch.Tensor):
            return self._readable(name, output)
        if isinstance(output, (tuple, list)):
            return type(output)((self._readable(name, o) if i == 0 else _local(o)) if isinstance(o, torch.Tensor)
                                and i < 2 else o for i, o in enumerate(output))
        return output

    def _row_post(self, handle, args, output) -> None:
        out = first_tensor(output)
        if out is not None and dtensor_placements(out) is not None:
            # a DTensor (use_local_output=False): its placements say whether it still owes its reduce
            # (Partial), its storage is the local one
            self.row_placements[handle.name] = list(dtensor_placements(out))
            out = out.to_local()
        self.add_row_output(handle.name, handle.index, out)

    def _in_norm_post(self, handle, args, output) -> None:
        self._record(in_norm(handle.index), first_tensor(output), copied=False)

    def add_row_output(self, module: str, layer: Optional[int], out: Optional[torch.Tensor]) -> None:
        """A module's output that holds a partial sum until a reduce (row-parallel, an MoE block).
        Its storage is held weakly: a later tensor at the same address, once this output was freed,
        is not this output (the allocator reuses addresses, differently on every rank)."""
        self.row_outputs.append({"module": module, "layer": layer,
                                 "ptr": out.data_ptr() if out is not None else None,
                                 "storage": StorageWeakRef(out.untyped_storage()) if out is not None else None,
                                 "reduced": any(r.source == module for r in self.allreduces)})

    # -- collective audit -----------------------------------------------------------------
    def collective(self, kind: str, path: str, inp, group_size: int, op: str = "SUM"):
        """Record one collective issued by a wrapper above c10d (see capture/audit.py)."""
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
        # the modules running this collective, innermost first: the layers' (from the frames) and
        # the embedding's (its hooks keep a stack: it is known only once it consumed the ids)
        running = running_modules(self._known, sys._getframe(1))
        module = running[0][0] if running else self._stack[-1][0] if self._stack else "<outside hooked modules>"
        layer = next((idx for _, kind, idx in running if kind == "layer"), None)
        in_embed = bool(self._stack)
        where = layer_place(-1 if in_embed else layer)
        source = next((name for name, kind, _ in running if kind == "row"), None)
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
                        layer, where = row["layer"], layer_place(row["layer"])
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

    def coverage(self) -> dict:
        """What was hooked and audited on this rank (part of the verdict: checks/coverage.py)."""
        per_layer: dict = {}
        paths: Counter = Counter()
        unread: Counter = Counter()
        for r in self.allreduces:
            paths[r.meta()["path"]] += 1
            if r.kind in ("all_reduce", "reduce_scatter", "unknown"):
                per_layer[r.where] = per_layer.get(r.where, 0) + 1
            if not r.checked:
                unread[r.meta()["path"]] += 1
        return {"embed": self.embed_name,
                "embed_how": self.embed_how or ("not found" if self.embed_name is None else ""),
                "embed_layout": self.embed_layout, "placements": dict(self.placements),
                "row_placements": dict(self.row_placements), "raised_in": self.raised_in,
                "unreadable_points": dict(self.unreadable),
                "layer_list": self.layer_list, "layer_how": self.layer_how, "layers_found": len(self.layer_indices),
                "layer_names": list(self._layer_names),
                "layers_ran": len(self.layers_ran),
                "layer_classes": sorted({type(m).__name__ for m in self._layer_modules()}),
                "reduces_per_place": per_layer, "paths": dict(paths), "unreadable_paths": dict(unread),
                "audit": self.audit,
                # how the audit watched: "kernel" (its dispatcher kernels) | "mode (why)" (the dispatch mode)
                "audit_path": self.auditor.path}

    def note_error(self, exc: BaseException) -> None:
        """Where the model's own forward raised: the innermost module of the model whose frame is on the
        exception's traceback (a plan that places a shard wrong fails in that module's matmul, as the
        library itself refuses it), as "layer K (module)", "embedding (module)" or the module's path."""
        names = {id(m): n for n, m in self.model.named_modules()}
        inner = None
        tb = exc.__traceback__
        while tb is not None:
            me = tb.tb_frame.f_locals.get("self")
            if isinstance(me, torch.nn.Module) and id(me) in names and names[id(me)]:
                inner = names[id(me)]
            tb = tb.tb_next
        if inner is None:
            return
        if self.embed_name and (inner == self.embed_name or inner.startswith(self.embed_name + ".")):
            self.raised_in = f"embedding ({inner})"
            return
        k = next((k for k, n in enumerate(self._layer_names) if inner == n or inner.startswith(n + ".")), None)
        self.raised_in = f"layer {k} ({inner})" if k is not None else inner

    def _layer_modules(self):
        return [self.model.get_submodule(n) for n in self._layer_names]
