"""What the audit records of a collective (`CollectiveRecord`), which ops it audits, what a complete one returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "unknown")
REDUCES = ("all_reduce", "reduce_scatter", "unknown")       # kinds that sum partial results
_OPS = {int(v): k for k, v in dist.ReduceOp.RedOpType.__members__.items()}
PASS = frozenset(("aten", "prim", "prims", "quantized", "_c10d_functional_autograd"))   # never collectives
_HINTS = ("all_reduce", "allreduce", "reduce_scatter", "reducescatter", "all_gather", "allgather", "alltoall",
          "all_to_all")
# c10d ops that move data without summing partial results: not part of the reduce audit
_NOT_REDUCE = frozenset(("broadcast_", "barrier", "send", "recv_", "recv_any_source_", "monitored_barrier_",
                         "gather_", "scatter_", "wait_tensor",
                         "_wrap_tensor_autograd", "broadcast",
                         # point-to-point, and the NaN check NCCL runs before a collective
                         # (TORCH_NCCL_NAN_CHECK=1): none is a collective of its own
                         "isend", "irecv", "batch_p2p_ops", "check_for_nan"))


@dataclass(slots=True)          # slots: one is made per collective, in the forward
class CollectiveRecord:
    seq: int
    module: str                     # innermost hooked module running when it was issued
    source: Optional[str]           # row-parallel module whose output it reduced, if known
    layer: Optional[int]            # decoder layer index, None outside layers
    where: str                      # "embed" | "layer.K" | "other"
    shape: tuple
    dtype: str
    group_size: int
    op: Any                         # "SUM", ...; or the op's ReduceOp as the collective got it, named
                                    # by meta() (a TorchBind call per collective, off the hot path)
    kind: str = "all_reduce"        # all_reduce | reduce_scatter | all_gather | unknown
    path: str = "c10d.allreduce_"   # the door it came through (op name or wrapper)
    via: list = field(default_factory=list)   # lower-level ops seen inside an outer record
    checked: bool = True            # False: the tensors could not be read (counted only)
    group: Optional[str] = None     # the issuing group's name when a wrapper knows it (SGLang: tp:0, attention_tp:0)
    group_ranks: Optional[list] = None   # its global ranks when not the whole world (a sub-group reduce)
    splits: Optional[list] = None   # an all-to-all's [output split sizes, input split sizes] ([] = equal chunks)
    inp: Optional[torch.Tensor] = None     # copy of the input (kept points only)
    out: Optional[torch.Tensor] = None
    inp_summary: Any = None
    out_summary: Any = None
    seconds: float = 0.0
    t0: float = 0.0                 # when it was issued (perf_counter), for `seconds`
    _out: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)   # rec.output()

    def meta(self) -> dict:
        return {"seq": self.seq, "module": self.module, "source": self.source, "layer": self.layer,
                "where": self.where, "shape": list(self.shape), "dtype": self.dtype,
                "group_size": self.group_size, "op": op_name(self.op), "kind": self.kind,
                "path": "+".join([self.path] + list(dict.fromkeys(self.via))), "checked": self.checked,
                "group": self.group, "group_ranks": self.group_ranks,
                **({"splits": self.splits} if self.splits is not None else {})}

    # an outer-level wrapper hands the result here
    def output(self, t: Optional[torch.Tensor]) -> None:
        self._out = t


DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def dtype_name(t: torch.Tensor) -> str:
    d = t.dtype
    n = DTYPE_NAMES.get(d)
    return n if n is not None else str(d).replace("torch.", "")


def audited(ns: str, name: str) -> bool:
    """Whether the op `ns::name` is a collective the audit records (read, or counted and named)."""
    if ns in PASS:
        return False
    if ns in ("c10d", "_c10d_functional"):
        return name not in _NOT_REDUCE
    low = name.lower()
    return any(h in low for h in _HINTS)


def op_name(op) -> str:
    if isinstance(op, str):
        return op.upper()
    try:
        if isinstance(op, dist.ReduceOp.RedOpType):       # a door's op (Python binding)
            return _OPS.get(int(op), str(op))
        if isinstance(op, dist.ReduceOp):
            return _OPS.get(int(op.op), str(op))
        return _OPS.get(int(op.op()), str(op))           # the dispatcher's (TorchBind)
    except Exception:
        return str(op).split(".")[-1]


def _reduce(ins: list[torch.Tensor], op: str) -> Optional[torch.Tensor]:
    """The reduction `op` of the inputs, in float64 (None for an op without a definition here)."""
    xs = [t.double() for t in ins]
    if op == "SUM":
        return sum(xs)
    if op == "AVG":
        return sum(xs) / len(xs)
    if op == "MAX":
        return torch.stack(xs).amax(0)
    if op == "MIN":
        return torch.stack(xs).amin(0)
    if op == "PRODUCT":
        return torch.stack(xs).prod(0)
    return None


def a2a_chunks(t: torch.Tensor, splits: Optional[list], world: int, is_input: bool) -> Optional[list]:
    """An all-to-all's input cut by destination rank, or its output by source rank (dim 0, by the
    split sizes it was given; none: equal chunks); None when the sizes do not fit the tensor."""
    sizes = list((splits or [[], []])[1 if is_input else 0])
    if not sizes:
        if world <= 0 or not t.dim() or t.shape[0] % world:
            return None
        sizes = [t.shape[0] // world] * world
    if not t.dim() or sum(sizes) != t.shape[0] or len(sizes) != world:
        return None
    return list(t.split(sizes, 0))


def expected_output(kind: str, ins: list[torch.Tensor], rank: int, world: int,
                    op: str = "SUM", splits: Optional[list] = None) -> Optional[torch.Tensor]:
    """What a complete collective returns on `rank`, from every rank's input (float64), by its
    own definition: the reduction `op` (SUM, AVG, MAX, MIN, PRODUCT); a reduce-scatter's `rank`-th
    slice of it; an all-gather's concatenation; an all-to-all's chunk `rank` of every rank's input,
    in rank order (`splits`: each member's [output, input] split sizes, in member order)."""
    if kind == "all_to_all":
        parts = []
        for q, t in enumerate(ins):
            chunks = a2a_chunks(t, (splits or [None] * len(ins))[q], world, is_input=True)
            if chunks is None:
                return None
            parts.append(chunks[rank].double())
        return torch.cat(parts, 0)
    if kind == "all_reduce":
        return _reduce(ins, op)
    if kind == "reduce_scatter":
        total = _reduce(ins, op)
        return total.chunk(world, 0)[rank] if total is not None and total.dim() and total.shape[0] % world == 0 \
            else None
    if kind == "all_gather":
        return torch.cat([t.double() for t in ins], 0)
    return None
