"""The Tap: what the probe sees during one forward on one rank (a context manager).

On enter it finds the decoder layers and the embedding from the model's structure
(capture/discover.py: the longest ModuleList; the module that consumes the input ids and emits
[tokens, hidden]), or from overrides (`embed=`, `layers=`: a module path or a class-name glob), hooks
the modules whose calls it reads (the decoder layers, row-parallel modules, layer 0's input norm,
the embedding: install.py), and starts the collective audit (capture/audit/): every collective's
input and output, group, path and the module that issued it (read from the frames of the module
calls running then: collectives.running_modules).  On exit every handle is removed and the audit
stopped, also when the forward raises.  `coverage()` says what was hooked and audited; the capture
points it records are capture/points.py's.

`keep(name) -> bool` decides which points keep a tensor; the others are passed to `summarize`
(e.g. a fingerprint) so the Tap never holds more than it must. All tensors kept are copies.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import discover
from ..audit import Audit, CollectiveRecord
from ..params import dtensor_placements
from ..points import EMBED_LOCAL, EMBED_OUT, EMBED_PLACE, IN_NORM, SHARE, STREAM, in_norm, layer_out, parse
from ..progress import Progress
from . import fast
from .collectives import Collectives
from .install import HookHandle, add_hooks
from .outputs import first_tensor, is_owed, local_tensor, residual_stream
from .plan import PLANS, REGISTRATIONS

_ROW_KINDS = (STREAM, SHARE, IN_NORM)    # capture points held as [tokens, hidden] (discover.rows)

# layer families that need model-specific extensions: module prefix -> () -> extensions. Filled by
# the family's own package when it is imported (tpprobe.engines.sglang.stream: "sglang."), so the Tap
# never imports a model family itself. Process-wide by nature: a registry of code, not of run state.
LAYER_EXTENSIONS: dict = {}


class Tap(Collectives):
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
        # a Deferred's calls go to C where its fast() has them (fingerprint/triton/native.py)
        fast = getattr(summarize, "fast", None)
        summarize = fast() if fast is not None else summarize
        self.keep, self.summarize = keep, summarize
        self._later = getattr(summarize, "later", None)     # Deferred.later: a launch the read makes
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
        self._layer_now: Optional[int] = None      # the decoder layer running (its hooks: pre sets, post clears)
        # the row-parallel module running, when it has no child module: (name, layer index) (pre sets, post
        # clears): a collective it issues is named from it, without the frame walk (collectives._attribution)
        self._row_now: Optional[tuple] = None
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
        # in a kernel launch for good (as a hung peer can); with it the forward raises DeviceStalled,
        # as a blocking backend's collective would, and the probe reports.
        self.device_lag = device_lag
        if device_lag is None:
            self.auditor.before = None             # nothing to bound: no call per collective
        self.device_stalled = False
        self.stream_from_layer_output = True
        # how the hooks were registered: "fast" (fast.py) or "public (why)" (torch's register_forward_*)
        self.hooks_path = ""
        self._fast = False
        self._registered = False
        self.sglang_layers = False                 # SGLang's layers: the stream comes from its boundaries
        self.stream_from_extension = False         # an extension records layer.K.out itself (vLLM's: at the norms)

    # -- install / remove -------------------------------------------------------------------
    def __enter__(self) -> "Tap":
        try:
            REGISTRATIONS.acquire()          # PyTorch's registration hooks: from the first Tap's enter
            self._registered = True
            why = fast.refused()
            self._fast = not why
            self.hooks_path = "fast" if self._fast else f"public ({why})"
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
        plan = PLANS.plan(self.model, self.layer_spec, self.embed_spec)
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
        for (idx, name, m, _), hooked in zip(plan.subs, plan.hooked):
            self.layer_indices.append(idx)
            self._hook(m, HookHandle("layer", name, idx), self._layer_post)
            for kind, sub_name, sub in hooked:
                # row-parallel outputs are noted; layer 0's input norm is a capture point (a
                # candidate for "the embedding slot was taken after a transform"): plan.hooked
                post = self._row_post if kind == "row" else self._in_norm_post
                self._hook(sub, HookHandle(kind, sub_name, idx), post)
        for prefix, factory in LAYER_EXTENSIONS.items():
            if any(type(m).__module__.startswith(prefix) for _, _, m in layers):
                # e.g. SGLang's own decoder layers (a user's --model factory too): their output is an
                # owed partial sum, so the stream is read where SGLang materializes it, and the reduces
                # at GroupCoordinator level (tpprobe.engines.sglang.stream registers itself here)
                self.extensions += tuple(e for e in factory() if e not in self.extensions)
                # vLLM's layers return (hidden_states, residual): the stream is read from them; a family whose
                # stream comes from its layers' boundaries says so on its factory (SGLang's)
                self.sglang_layers = self.sglang_layers or getattr(factory, "stream_at_boundaries", False)
        for ext in self.extensions:
            self._ext_handles += list(ext(self) or [])
        if self.audit:
            # a model holding inference tensors: collectives on them bypass the audit's
            # ADInplaceOrView kernels, so the audit watches through its dispatch mode (capture/audit/mode.py)
            self.auditor.use_mode = self.auditor.use_mode or plan.inference
            self.auditor.__enter__()
            self._auditing = True
            self._arm_native()

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
                    out = local_tensor(first_tensor(output))      # kept as this rank's tensor: no DTensor op
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

        handle.handles += add_hooks(module, pre, post, with_kwargs=True, fast_path=self._fast)
        self.handles.append(handle)

    def _embed_found(self, name, handle, args, output, layout, ids_shape) -> None:
        self.embed_name, self.embed_how = name, "structure"
        self.embed_layout, self._ids_shape = layout, ids_shape
        if self._plan_cache is not None:
            self._plan_cache.found = name
        self._embed_post(handle, args, output)

    def _hook(self, module, handle: HookHandle, post) -> None:
        """A decoder layer: pre says where the forward is (the watchdog's heartbeat), post reads its
        output; a row-parallel module with no child module: pre and post say it is running; another
        module: post only. ``post(handle, args, output)``."""
        pre = None

        def post_(mod, args, output):
            post(handle, args, output)

        if handle.kind == "layer":
            progress, where, idx = self.progress, f"layer {handle.index}", handle.index

            def pre(mod, args):
                self._layer_now, self._row_now = idx, None     # (a row module that raised never cleared it)
                progress.set("forward", where)
        elif handle.kind == "row" and not module._modules:
            # a leaf: nothing known runs inside its call, so while it runs it is the innermost known module
            row = (handle.name, handle.index)

            def pre(mod, args):
                self._row_now = row

            def post_(mod, args, output):
                self._row_now = None
                post(handle, args, output)

        handle.handles += add_hooks(module, pre, post_, wrap=True, fast_path=self._fast)
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
        if self._registered:                 # ... to the last Tap's exit
            self._registered = False
            REGISTRATIONS.release()

    # -- capture --------------------------------------------------------------------------
    def _record(self, name: str, t: Optional[torch.Tensor], copied: bool) -> None:
        if t is None:
            return
        if type(t) is not torch.Tensor:       # a plain tensor is readable as it is
            t = self._readable(name, t)
            if t is None:
                return
        # a 2-D tensor is never a sequence shard and is its own rows (discover.rows)
        if self.embed_layout is not None and t.dim() != 2 and parse(name).kind in _ROW_KINDS:
            if discover.is_sequence_shard(t, self.embed_layout, self._ids_shape, self._world):
                self.after[name] = len(self.allreduces)
                self.order.append(name)
                self._seq_shards[name] = t.detach().clone()     # gathered after the forward
                return
            t = discover.rows(t, self.embed_layout, self._ids_shape)
        self.after[name] = len(self.allreduces)
        self.order.append(name)
        if self.keep(name) and self._admitted(name, t):
            c = self.captures[name] = self._copy(t, copied)
            if c is not t and c.shape == t.shape:      # a whole copy: the Tap's own, as t is when copied
                t, copied = c, True
        if self.summarize is not None:
            # a tensor of the Tap's own is never written again: its fingerprint can wait for the read
            later = self._later if copied else None
            self.summaries[name] = later(t) if later is not None else self.summarize(t)

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
        self._layer_now = None
        name = layer_out(handle.index)
        self.layers_ran.add(handle.index)
        if not self.stream_from_layer_output or self.sglang_layers or self.stream_from_extension or is_owed(output):
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
        if type(output) is tuple and len(output) == 2 and type(output[0]) is torch.Tensor \
                and type(output[1]) is torch.Tensor:
            return output                      # (hidden, residual) of plain tensors: nothing to replace
        if isinstance(output, torch.Tensor):
            return self._readable(name, output)
        if isinstance(output, (tuple, list)):
            return type(output)((self._readable(name, o) if i == 0 else local_tensor(o)) if isinstance(o, torch.Tensor)
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
        # reduced already (inside the module, its own all-reduce): never matched to a later reduce, so
        # neither its address nor its storage is kept
        reduced = any(r.source == module for r in reversed(self.allreduces))
        held = out is not None and not reduced
        self.row_outputs.append({"module": module, "layer": layer,
                                 "ptr": out.data_ptr() if held else None,
                                 "storage": StorageWeakRef(out.untyped_storage()) if held else None,
                                 "reduced": reduced})


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
