"""Serving-path faults injected into SGLang's own model (`tpprobe probe --engine sglang --inject`).

Each one changes what SGLang's EAGLE-3 aux capture stores the way the real bug did, at the stage
boundary where SGLang 0.5.23 captures (`StageBoundary._prepare_attention`), and never touches
what tpprobe observes of the residual stream: the probe must find it on its own.

  fused-allreduce-capture (F16)  the aux capture reads the stream BEFORE the owed (deferred, on GPUs
      fused into add+RMSNorm) all-reduce of the previous layer completes: each rank stores its own
      partial sum plus the residual, the pre-fix capture point of sglang PR #28343.
  dp-attention-gather (F17)      under DP attention the aux rows (each attention-TP rank's share of
      its group's tokens) are all-gathered over the TP group instead of the attention-TP group, so
      the draft gets every attention-DP group's rows (sglang PR #20492, issue #16274).
  capture-no-residual (F18)      the aux capture stores the previous layer's output alone (the
      reduced delta, `hidden_states`) instead of the stream (hidden + residual): SpecForge#431,
      sglang#39286.
  embed-after-layer0 (F13)       the build's capture rule puts the embedding's slot at capture point 1,
      the stream after the first (dense) decoder layer, instead of 0: the "embedding" the draft gets
      is layer 0's output, one layer late (the seed's third guess about its hand-patched id -1).
  slice-capture (F6)             the aux capture stores this rank's hidden/tp slice of the stream (as a
      capture reading a reduce-scattered stream would), so the packed aux is K × hidden/tp wide and
      every rank holds a different slice.
  skip-embed-allreduce (F1)      SGLang's VocabParallelEmbedding returns each rank's partial rows: its
      forward sees the attention-TP input-scattered flag (the mode in which SGLang itself skips the
      reduce), scoped to the embedding call only, while the layers run their gathered path.

How: the capturing layers' `attn_boundary.prepare` is wrapped to note, before SGLang completes
the owed sum, the rank-local partial and the residual; SGLang's aux collectors
(`AuxHiddenStateList.capture`, `AuxHiddenStatePacker.capture`) then store the faulty value in
place of the value SGLang hands them, only during that boundary.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from ...config.knobs import knob_float
from ...core.errors import UsageError
from ..fault_fired import counter

SGLANG_FAULTS = ("fused-allreduce-capture", "capture-no-residual", "dp-attention-gather", "embed-after-layer0",
                 "slice-capture", "skip-embed-allreduce")
# F22-F25 through SGLang's own all-reduce (GroupCoordinator.all_reduce): see reduce_fault below
REDUCE_FAULTS = ("allreduce-scaled", "allreduce-one-buffer", "allreduce-stale", "allreduce-rank", "skip-allreduce-all",
                 "skip-unreadable-allreduce", "skip-allreduce")

# process-wide by nature: the collectors' class method is patched once per process (_patch_collectors), and
# these are what it reads: the fault of the boundary running now on this thread, and one on every aux capture
_pending = threading.local()
_ALWAYS: dict = {"fn": None}       # a fault on every aux capture (dp-attention-gather)


def _layers(model):
    from tpprobe.engines.sglang.stream import decoder_layers
    return decoder_layers(model)


def _patch_collectors() -> None:
    from sglang.srt.layers import aux_hidden_states as aux

    for cls in (aux.AuxHiddenStateList, aux.AuxHiddenStatePacker):
        if getattr(cls.capture, "_tpprobe_fault", False):
            continue
        orig = cls.capture

        def capture(self, hidden, *, owned: bool = False, _orig=orig):
            fault = getattr(_pending, "fn", None) or _ALWAYS["fn"]
            if fault is not None:
                hidden, owned = fault(hidden), True
            return _orig(self, hidden, owned=owned)

        capture._tpprobe_fault = True
        cls.capture = capture


def inject(name: str, model, arg: Optional[int] = None, ctx=None) -> None:
    """Apply serving fault `name` to SGLang model `model` (every capturing boundary)."""
    from sglang.srt.layers.layer_boundary.residual.stream import OwedOutput

    if name in REDUCE_FAULTS:
        reduce_fault(name, model, arg, ctx)
        return
    if name == "skip-embed-allreduce":
        skip_embed_reduce(model)
        return
    if name == "embed-after-layer0":
        embed_after_layer0(model)
        return
    _patch_collectors()
    always = name in ("dp-attention-gather", "slice-capture")
    fire = counter("an EAGLE-3 aux capture (SGLang's AuxHiddenStateList / AuxHiddenStatePacker.capture)"
                   + ("" if always else " at a decoder layer's attention boundary, with a residual stream set"))

    def counted(fn):
        def f(v):
            fire()
            return fn(v)
        return f
    if name == "dp-attention-gather":
        _ALWAYS["fn"] = counted(gather_over_tp_group)
        return
    if name == "slice-capture":
        _ALWAYS["fn"] = counted(tp_slice)
        return
    for i, layer in enumerate(_layers(model)):
        if i == 0:
            continue                     # capture point 0 is the embedding: no residual yet
        b = getattr(layer, "attn_boundary", None)
        if b is None:
            continue
        orig = b.prepare

        def prepare(hidden_states, forward_batch, *a, _orig=orig, **kw):
            stream = getattr(forward_batch, "residual_stream", None)
            residual = getattr(stream, "residual", None)
            fn = None
            if isinstance(residual, torch.Tensor):
                old = residual.detach().clone()
                if name == "fused-allreduce-capture":
                    partial = _partial(hidden_states, OwedOutput)
                    if partial is not None:
                        fn = counted(lambda v, p=partial, r=old: (p + r).to(v.dtype))
                elif name == "capture-no-residual":
                    fn = counted(lambda v, r=old: (v - r).to(v.dtype))
            _pending.fn = fn
            try:
                return _orig(hidden_states, forward_batch, *a, **kw)
            finally:
                _pending.fn = None

        b.prepare = prepare


def tp_slice(value: torch.Tensor) -> torch.Tensor:
    """F6: this TP rank's hidden/tp slice of the captured stream (a copy, owned by the collector)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return value.tensor_split(tp.world_size, dim=-1)[tp.rank_in_group].contiguous()


def _text_model(model):
    from tpprobe.engines.sglang.stream import text_model
    return text_model(model)[0]


def skip_embed_reduce(model) -> None:
    """F1 the way SGLang itself skips it: VocabParallelEmbedding.forward returns the rank's partial rows
    when `get_attn_tp_context().input_scattered` holds; the flag is set for the embedding call only."""
    from sglang.srt.runtime_context import get_forward

    emb = _text_model(model).model.embed_tokens
    orig = emb.forward

    def forward(input_, _orig=orig):
        with get_forward().scoped(attn_input_scattered=True):
            return _orig(input_)

    emb.forward = forward


def embed_after_layer0(model) -> None:
    """F13: the capture rule maps the embedding's slot (capture point 0) to capture point 1, the stream
    after the first decoder layer; every other id keeps its point (the model's layers_to_capture, which
    its forward loop reads, is rewritten after set_eagle3_layers_to_capture)."""
    inner = _text_model(model).model
    ltc = list(getattr(inner, "layers_to_capture", []) or [])
    if 0 not in ltc:
        raise UsageError("--inject embed-after-layer0 needs an id that captures the embedding (capture point 0: "
                         "id 0 under DeepSeek's rule, -1 under Llama's)")
    if 1 in ltc:
        raise UsageError("--inject embed-after-layer0 moves the embedding's capture to point 1, which these ids "
                         "capture already: choose ids without capture point 1 (e.g. 0,2 on DeepSeek)")
    inner.layers_to_capture = sorted(1 if p == 0 else p for p in ltc)
    for i, layer in enumerate(inner.layers):            # the Qwen-MoE family's per-layer flag, where present
        if hasattr(layer, "_is_layer_to_capture"):
            layer._is_layer_to_capture = i in inner.layers_to_capture


def gather_over_tp_group(value: torch.Tensor) -> torch.Tensor:
    """F17 (sglang PR #20492): the aux rows are this rank's attention-TP share of the DP-local
    tokens, and they are all-gathered over the TP group where the attention-TP group was meant:
    the result holds every attention-DP group's rows, not this group's."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group

    attn, tp = get_attn_tp_group(), get_tp_group()
    rows = value.shape[0] // attn.world_size
    mine = value[attn.rank_in_group * rows:(attn.rank_in_group + 1) * rows].contiguous()
    return tp.all_gather(mine, dim=0)


def _partial(hidden, owed_cls) -> Optional[torch.Tensor]:
    """This rank's partial sum still owed by the previous layer (a copy), or None when complete."""
    if not isinstance(hidden, owed_cls):
        return None
    c = hidden.contribution
    if c.owed is None or not isinstance(c.value, torch.Tensor):
        return None
    return c.value.detach().clone()


# ---- F22-F25: SGLang's own all-reduce breaks ------------------------------------------------------
# Every TP reduce of an SGLang model goes through GroupCoordinator.all_reduce, which on GPUs
# dispatches to custom all-reduce, pynccl, symmetric memory..., the part that breaks. The faults
# below break it there, at one row-parallel module's reduce (found by its output tensor: SGLang
# reduces the o_proj output itself, possibly at the next boundary), before the probe's Tap wraps the
# coordinator, so the audit sees the broken call as SGLang issues it:
#
#   allreduce-scaled@K, -one-buffer@K, -stale@K (F22)  layer K's o_proj reduce returns the sum x
#       TPPROBE_INJECT_SCALE (2), rank 0's input, or the previous reduce's output, on every rank
#   allreduce-rank@R (F23)  on rank R, the middle layer's o_proj reduce returns R's own input
#   skip-allreduce-all (F24)  no o_proj output is ever reduced (reduce_results=False in every layer and
#       nobody reduces): the tp group's coordinator returns those tensors unreduced, unaudited
#   skip-allreduce@K (F2)  the same in layer K only (a dense or an MoE layer: their reduce counts differ)
#   skip-unreadable-allreduce@K (F25)  the tp group reduces through an op the audit counts but cannot
#       read (like vLLM's CPU `_C.shm_allreduce`), bypassing the coordinator; layer K's o_proj reduce
#       is never issued
#
# Each finds the reduce of o_proj's output itself, or of a buffer its rows were copied into: under DP attention
# SGLang copies them into its gathered buffer (dp_gather_partial) and the TP group reduces that buffer.
# A corrupt call still runs the real reduce, so every rank issues the same collectives.
def _o_projs(model) -> list:
    out = []
    for layer in _layers(model):
        attn = getattr(layer, "self_attn", None)
        out.append(getattr(attn, "o_proj", None))
    return out


def reduce_fault(name: str, model, arg: Optional[int], ctx) -> None:
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator, get_tp_group

    projs = _o_projs(model)
    L = len(projs)
    k = L // 2 if name == "allreduce-rank" else (arg if arg is not None else L // 2)
    rank = ctx.rank if ctx is not None else dist.get_rank()
    ptrs: dict = {}            # data_ptr of each watched o_proj output of this forward -> layer index
    # the watched o_proj output itself, not a copy, until a reduce of a buffer holding its rows: one rank of each
    # attention-TP group adds the residual to it in place before the gather (_dp_gather_sum_read)
    rows: dict = {}

    def note(i):
        def hook(m, a, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                ptrs[t.data_ptr()] = i
                rows["t"] = t
        return hook
    watch = range(L) if name in ("skip-allreduce-all",) else [k]
    for i in watch:
        if projs[i] is not None:
            projs[i].register_forward_hook(note(i))
    layers = "every layer's" if name == "skip-allreduce-all" else f"layer {k}'s"
    fire = counter(f"{layers} self_attn.o_proj output in the TP group's all-reduce (GroupCoordinator.all_reduce)"
                   " or in a buffer it was copied into"
                   + (f", on rank {arg}" if name == "allreduce-rank" else ""))

    def hit(x) -> bool:
        if not isinstance(x, torch.Tensor):
            return False
        if ptrs.pop(x.data_ptr(), None) is not None:
            rows.clear()
            return True
        if rows and _holds_rows(x, rows["t"]):
            rows.clear()
            ptrs.clear()
            return True
        return False

    tp = get_tp_group()
    if name in ("skip-allreduce-all", "skip-allreduce"):
        def all_reduce(input_, *a, **kw):
            if hit(input_):
                fire()
                return input_                               # nobody reduces it
            return GroupCoordinator.all_reduce(tp, input_, *a, **kw)
        tp.all_reduce = all_reduce
        return
    if name == "skip-unreadable-allreduce":
        from ..fault_ops import shm_allreduce_op
        shm = shm_allreduce_op(tp.device_group)

        def all_reduce(input_, *a, **kw):
            if hit(input_):
                fire()
                return input_                               # never issued
            if not isinstance(input_, torch.Tensor) or tp.world_size == 1:
                return GroupCoordinator.all_reduce(tp, input_, *a, **kw)
            return input_.copy_(shm(input_))                # in place, like SGLang's
        tp.all_reduce = all_reduce
        return

    scale = knob_float("TPPROBE_INJECT_SCALE")
    orig = GroupCoordinator.__dict__["all_reduce"]
    last: dict = {}

    def all_reduce(self, input_, *a, **kw):
        if not isinstance(input_, torch.Tensor) or self is not tp or not hit(input_):
            out = orig(self, input_, *a, **kw)
            if isinstance(out, torch.Tensor) and self is tp:
                last["out"] = out.detach().clone()
            return out
        mine = input_.detach().clone()
        out = orig(self, input_, *a, **kw)
        if name == "allreduce-rank" and rank != arg:
            pass                                            # right on the other ranks
        elif name == "allreduce-scaled":
            out = out * scale
        elif name == "allreduce-one-buffer":
            dist.broadcast(mine, src=self.ranks[0], group=self.device_group)
            out = mine
        elif name == "allreduce-stale":
            prev = last.get("out")
            out = prev.clone() if prev is not None and prev.shape == out.shape else torch.zeros_like(out)
        elif name == "allreduce-rank":
            out = mine
        if name != "allreduce-rank" or rank == arg:
            fire()
        last["out"] = out.detach().clone()
        return out

    GroupCoordinator.all_reduce = all_reduce


def _holds_rows(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `x` holds all of `t`'s rows, in order, at some offset (a gathered buffer `t` was copied into)."""
    n = t.shape[0] if t.dim() else 0
    if n == 0 or x.dtype != t.dtype or x.dim() != t.dim() or x.shape[1:] != t.shape[1:] or x.shape[0] < n:
        return False
    flat = x.reshape(x.shape[0], -1)
    starts = (flat == t.reshape(n, -1)[0]).all(dim=1).nonzero().flatten().tolist()
    return any(s + n <= x.shape[0] and torch.equal(x[s:s + n], t) for s in starts)
