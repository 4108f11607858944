"""vLLM's GPU all-reduce paths, made to run on CPU over gloo, in one tiny model (`--model` factories for
tests/engines/vllm/test_vllm_gpu_paths.py, the vLLM tier).

The TP group is vLLM's own (`init_distributed_environment` + `initialize_model_parallel` over the probe's
gloo world); its device communicator is vLLM's `CudaCommunicator`, whose `all_reduce` picks the path with
its own code (the order and the size / dtype gates are vLLM's). What cannot run on a CPU is substituted, at
the lowest point that can, and nothing above it:

- `CudaCommunicator` and each communicator below it are made with `object.__new__` and given the
  attributes their `__init__` leaves on a GPU (their `__init__` opens CUDA IPC handles, NCCL, symmetric
  memory: none exists here); `DeviceCommunicatorBase.__init__` runs as it is.
- custom all-reduce (`CustomAllreduce`): `custom_all_reduce.ops` (vLLM's C++/CUDA op bindings) is replaced by
  `CustomArOps`, whose `all_reduce(handle, inp, out, buffer, size)` sums over gloo; `custom_all_reduce`,
  `should_custom_ar` (vLLM's size gate) and the chunking `all_reduce` are vLLM's.
- pynccl (`PyNcclCommunicator`): its `nccl` (the ctypes binding of libnccl) is `GlooNccl`, whose
  `ncclAllReduce(send, recv, count, dtype, op, comm, stream)` reads the two buffers at their addresses and sums
  over gloo; the CPU stream placeholder vLLM hands out gets a null `cuda_stream` handle. The rest is vLLM's.
- torch symmetric memory (`SymmMemCommunicator`): a CPU kernel for `torch.ops.symm_mem.two_shot_all_reduce_`
  and `multimem_all_reduce_` (CUDA-only in torch) that sums in place over gloo; its dtype is the model's
  (vLLM's is bfloat16); the copy in and out of the buffer is vLLM's.
- FlashInfer (standalone `FlashInferAllReduce` and the fused all-reduce + RMSNorm op): FlashInfer is not
  installed; a stand-in `flashinfer.comm` (`allreduce_fusion`, `create_allreduce_fusion_workspace`,
  `AllReduceFusionPattern`) is put in `sys.modules` before vLLM imports it, so vLLM's own modules define and
  register their code on it (`torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm`, `get_fi_ar_workspace`).
  `FlashInferAllReduce.should_use_fi_ar` starts with `input_tensor.is_cuda`: the instance's gate is replaced.
- which path a layer takes: each layer's pre-hook sets the other communicators' `disabled` flags (what vLLM
  sets when one is unavailable), so `CudaCommunicator.all_reduce` falls through to that layer's path.

`WRONG` (filled by `build_wrong_sums`): every path's substituted kernel returns the sum scaled by 2 (the live
failure: a custom all-reduce returning wrong data, F22).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import shutil
import sys
import tempfile
import types

import torch
import torch.distributed as dist

from tpprobe import ProbeTarget, RankContext

HIDDEN, TOKENS, SEED = 32, 8, 0
# layer k's path: vLLM's communicator it goes through (ROUTES[k]); "op": the compiled-graph form (torch.compile,
# eager backend, fullgraph): the graph calls torch.ops.vllm.all_reduce without GroupCoordinator.all_reduce (it
# reaches custom all-reduce); "fused":
# torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm, as the AllReduceFusionPass puts it in the graph
ROUTES = ("custom", "symm_mem", "pynccl", "torch", "flashinfer", "fused", "op")
WRONG: dict = {}
FI_PLAIN, FI_RESIDUAL_RMSNORM = 0, 1


def _wrong(path: str, out: torch.Tensor) -> None:
    if WRONG.get(path) == "scaled":
        out.mul_(2.0)


# -- FlashInfer's comm module, stand-in ------------------------------------------------------------------------
class _Patterns:
    kAllReduce = FI_PLAIN
    kARResidualRMSNorm = FI_RESIDUAL_RMSNORM
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3


class _Workspace:
    def __init__(self, backend, group):
        self.backend, self.group, self.mc_ptr = backend, group, 1

    def is_buffer_size_sufficient(self, **kw) -> bool:
        return True

    def destroy(self) -> None:
        pass


def _allreduce_fusion(input, workspace, pattern, launch_with_pdl=False, output=None, residual_out=None,
                      norm_out=None, quant_out=None, scale_out=None, residual_in=None, rms_gamma=None, rms_eps=None,
                      scale_factor=None, layout_code=None, use_oneshot=None, fp32_acc=False, weight_bias=0.0,
                      trigger_completion_at_end=True):
    """FlashInfer's documented semantics on CPU: the sum over the workspace's group; the plain pattern returns
    it, the residual + RMSNorm pattern writes sum + residual_in to residual_out and its RMSNorm to norm_out."""
    s = input.detach().clone()
    dist.all_reduce(s, group=workspace.group)
    if pattern == FI_PLAIN:
        _wrong("flashinfer", s)
        out = output if output is not None else torch.empty_like(input)
        out.copy_(s)
        return out
    if pattern != FI_RESIDUAL_RMSNORM:
        raise NotImplementedError(f"pattern {pattern}: the CPU stand-in has no quantizing patterns")
    _wrong("fused", s)
    res = (s.float() + residual_in.float())
    normed = res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + rms_eps) * (rms_gamma.float() + weight_bias)
    residual_out.copy_(res.to(residual_out.dtype))
    norm_out.copy_(normed.to(norm_out.dtype))
    return None


def _create_workspace(backend, world_size, rank, max_token_num, hidden_dim, dtype, comm_backend=None, group=None,
                      **kw):
    return _Workspace(backend, group)


def install_flashinfer() -> None:
    """The stand-in `flashinfer`, `flashinfer.comm`, `flashinfer.comm.mnnvl` in sys.modules (before vLLM
    imports them)."""
    if "flashinfer" in sys.modules:
        return
    pkg = types.ModuleType("flashinfer")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    pkg.__path__ = []
    comm = types.ModuleType("flashinfer.comm")
    comm.__spec__ = importlib.machinery.ModuleSpec("flashinfer.comm", None, is_package=True)
    comm.__path__ = []
    comm.allreduce_fusion = _allreduce_fusion
    comm.create_allreduce_fusion_workspace = _create_workspace
    comm.AllReduceFusionPattern = _Patterns
    comm.QuantizationSFLayout = types.SimpleNamespace(SWIZZLED_128x4=0)
    mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
    mnnvl.__spec__ = importlib.machinery.ModuleSpec("flashinfer.comm.mnnvl", None)
    mnnvl.TorchDistBackend = lambda group=None: types.SimpleNamespace(group=group)
    pkg.comm, comm.mnnvl = comm, mnnvl
    sys.modules.update({"flashinfer": pkg, "flashinfer.comm": comm, "flashinfer.comm.mnnvl": mnnvl})


FUSION = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
# what of vLLM's fusion-pass module defines and registers the fused op (the rest builds Inductor patterns)
_FUSED_DEFS = {"PDL_ADVANCE_LAUNCH_TOKENS", "_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB", "MiB",
               "_select_flashinfer_allreduce_use_oneshot"}


def load_fused_op() -> types.ModuleType:
    """vLLM's fused all-reduce + RMSNorm op, from vLLM's own source: its fusion-pass module cannot be imported
    on CPU (rms_quant_fusion, which it imports, reads CUDA-only `torch.ops._C` quant ops at import), so the
    statements that define and register the op (`call_trtllm_fused_allreduce_norm` under `if flashinfer_comm
    is not None:`, and the constants and the one-shot choice it reads) are taken verbatim from the installed
    file and run with the names it imports; the module is registered under its own name, as vLLM's pass
    manager leaves it on a GPU."""
    import ast
    import importlib.util

    if FUSION in sys.modules:
        return sys.modules[FUSION]
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import direct_register_custom_op

    path = importlib.util.find_spec(FUSION).origin
    tree = ast.parse(open(path).read(), path)
    body = []
    for node in tree.body:
        names = {t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef) and node.name in _FUSED_DEFS or names & _FUSED_DEFS:
            body.append(node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "flashinfer_comm is not None":
            body.append(node)
    mod = types.ModuleType(FUSION)
    mod.__file__ = path
    mod.__dict__.update(torch=torch, current_platform=current_platform, get_tp_group=get_tp_group,
                        get_tensor_model_parallel_rank=get_tensor_model_parallel_rank,
                        direct_register_custom_op=direct_register_custom_op,
                        flashinfer_comm=sys.modules["flashinfer.comm"])
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), mod.__dict__)
    assert hasattr(torch.ops.vllm, "flashinfer_trtllm_fused_allreduce_norm"), "vLLM's fused op was not registered"
    sys.modules[FUSION] = mod
    return mod


# -- the other kernels, on CPU over gloo -------------------------------------------------------------------------
class CustomArOps:
    """Stands in for `vllm._custom_ops` inside custom_all_reduce.py: the CUDA IPC kernel's entry."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    @staticmethod
    def all_reduce(fa, inp, out, reg_buffer, reg_buffer_sz_bytes):
        out.copy_(inp)
        dist.all_reduce(out, group=fa.group)
        _wrong("custom", out)


class CustomArHandle:
    """The custom all-reduce's handle (vLLM's `_ptr`): the group to sum over. It owns no CUDA IPC memory, so it is
    falsy: vLLM's `CustomAllreduce.close` (run by `__del__`) has nothing to dispose or free."""

    def __init__(self, group):
        self.group = group

    def __bool__(self) -> bool:
        return False


_NCCL_DTYPES = {6: torch.float16, 7: torch.float32, 8: torch.float64, 9: torch.bfloat16}


def _at(ptr, count: int, dtype: torch.dtype) -> torch.Tensor:
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr.value)
    return torch.frombuffer(buf, dtype=dtype, count=count)


class GlooNccl:
    """Stands in for pynccl's `NCCLLibrary` (libnccl through ctypes): all-reduce over gloo."""

    def __init__(self, group):
        self.group = group

    def ncclAllReduce(self, sendbuff, recvbuff, count, datatype, op, comm, stream):
        dtype = _NCCL_DTYPES[int(datatype)]
        send, recv = _at(sendbuff, count, dtype), _at(recvbuff, count, dtype)
        recv.copy_(send)
        dist.all_reduce(recv, group=self.group)
        _wrong("pynccl", recv)

    def ncclCommAbort(self, comm) -> None:
        pass


_SYMM_GROUPS: dict = {}
_SYMM_LIB = None


def install_symm_mem_kernels(group) -> None:
    """CPU kernels for torch's symmetric-memory all-reduce ops (CUDA-only in torch): in place, over gloo."""
    global _SYMM_LIB
    _SYMM_GROUPS[group.group_name] = group
    if _SYMM_LIB is not None:
        return

    def reduce_(buf, reduce_op, group_name):
        dist.all_reduce(buf, group=_SYMM_GROUPS[group_name])
        _wrong("symm_mem", buf)
        return buf

    _SYMM_LIB = torch.library.Library("symm_mem", "IMPL")
    _SYMM_LIB.impl("two_shot_all_reduce_", reduce_, "CPU")
    _SYMM_LIB.impl("multimem_all_reduce_", reduce_, "CPU")


# -- vLLM's CudaCommunicator, its communicators made to run on CPU ---------------------------------------------------
def cuda_communicator(tp):
    """vLLM's CudaCommunicator for the TP group `tp`, every GPU path present and running on CPU (see the
    module docstring). Returns it; `route(cc, path)` picks the path the next reduce takes."""
    from vllm.distributed.device_communicators import custom_all_reduce as car
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.distributed.device_communicators.flashinfer_all_reduce import FlashInferAllReduce
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.symm_mem import SymmMemCommunicator
    from vllm.utils.torch_utils import current_stream

    cpu, group, ws, rank = torch.device("cpu"), tp.cpu_group, tp.world_size, tp.rank_in_group
    cc = object.__new__(CudaCommunicator)
    DeviceCommunicatorBase.__init__(cc, group, cpu, tp.device_group, tp.unique_name)
    cc.use_custom_allreduce = cc.use_torch_symm_mem = cc.use_flashinfer_allreduce = True
    cc.use_flashinfer_pcie_ipc_allreduce = cc.use_aiter_allreduce = cc.use_aiter_ag_rs = False
    cc.qr_comm = cc.fi_pcie_ipc_ar_comm = cc.aiter_ar_comm = None

    if not isinstance(car.ops, CustomArOps):
        car.ops = CustomArOps(car.ops)
    ca = object.__new__(car.CustomAllreduce)
    ca.__dict__.update(disabled=False, group=group, rank=rank, world_size=ws, fully_connected=True,
                       max_size=8 * 1024 * 1024, batch_invariant=False, _IS_CAPTURING=False,
                       _capture_registered=False, buffer_ptrs=[0] * ws, _ptr=CustomArHandle(group))
    cc.ca_comm = ca

    nc = object.__new__(PyNcclCommunicator)
    nc.__dict__.update(rank=rank, world_size=ws, group=group, available=True, disabled=False, _suspended=False,
                       device=cpu, comm=None, nccl=GlooNccl(group), nccl_version=0)
    cc.pynccl_comm = nc
    stream = type(current_stream())           # vLLM's CPU placeholder stream: NCCL gets a null stream handle
    if not hasattr(stream, "cuda_stream"):
        stream.cuda_stream = 0

    install_symm_mem_kernels(group)
    sm = object.__new__(SymmMemCommunicator)
    sm.__dict__.update(disabled=False, dtype=torch.float32, device=cpu, group=group, world_size=ws,
                       device_capability="9.0", max_size=1024 * 1024, force_multimem=None)
    sm.buffer = torch.empty(sm.max_size // sm.dtype.itemsize, dtype=sm.dtype)
    cc.symm_mem_comm = sm

    fi = object.__new__(FlashInferAllReduce)
    fi.__dict__.update(disabled=False, group=group, world_size=ws, rank=rank, device=cpu,
                       max_workspace_size=1024 * 1024, max_num_tokens=1024 * 1024 // (HIDDEN * 4))
    # vLLM's gate opens with `input_tensor.is_cuda`: on CPU the instance's gate says whether it is enabled
    fi.should_use_fi_ar = lambda x, _fi=fi: not _fi.disabled
    cc.fi_ar_comm = fi
    return cc


def route(cc, path: str, tp=None) -> None:
    """The next reduce through CudaCommunicator.all_reduce takes `path`: the communicators before it in vLLM's
    order are disabled (as vLLM disables one that is unavailable or gated out). "op": the TP coordinator calls
    the custom op, as on CUDA (`use_custom_op_call`; vLLM's CPU platform says no)."""
    if tp is not None:
        tp.use_custom_op_call = path == "op"
    cc.fi_ar_comm.disabled = path != "flashinfer"
    cc.ca_comm.disabled = path not in ("custom", "op")
    cc.symm_mem_comm.disabled = path != "symm_mem"
    cc.pynccl_comm.disabled = path != "pynccl"


# -- the model -----------------------------------------------------------------------------------------------------
class Proj(torch.nn.Module):
    """Row-parallel: this rank's input features times its slice of W, reduced through vLLM (path `path`)."""

    def __init__(self, w: torch.Tensor, rank: int, world: int, path: str):
        super().__init__()
        cols = w.shape[1] // world
        self.lo, self.hi, self.path, self.compiled = rank * cols, (rank + 1) * cols, path, None
        self.weight = torch.nn.Parameter(w[:, self.lo:self.hi].contiguous(), requires_grad=False)
        self.gamma = torch.nn.Parameter(torch.ones(w.shape[0]), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

        part = h[:, self.lo:self.hi] @ self.weight.T
        if self.path == "fused":     # what the AllReduceFusionPass puts in the graph: reduce + residual add + RMSNorm
            res = h.clone()
            torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm(
                allreduce_in=part, residual=res, norm_out=None, quant_out=None, scale_out=None, rms_gamma=self.gamma,
                rms_eps=1e-6, pattern_code=FI_RESIDUAL_RMSNORM, world_size=get_tp_group().world_size,
                launch_with_pdl=True, fp32_acc=True, max_token_num=TOKENS)
            return res
        if self.path == "op":
            # a compiled graph's reduce: Dynamo traces GroupCoordinator.all_reduce (use_custom_op_call set, as on
            # CUDA) away; the graph calls torch.ops.vllm.all_reduce, the Python method never runs
            if self.compiled is None:
                self.compiled = torch.compile(tensor_model_parallel_all_reduce, backend="eager", fullgraph=True)
            return h + self.compiled(part)
        return h + tensor_model_parallel_all_reduce(part)


class Layer(torch.nn.Module):
    def __init__(self, w, rank, world, path):
        super().__init__()
        self.proj = Proj(w, rank, world, path)

    def forward(self, h):
        return self.proj(h)


class PathsModel(torch.nn.Module):
    def __init__(self, rank: int, world: int):
        super().__init__()
        g = torch.Generator().manual_seed(SEED)
        self.embed = torch.nn.Embedding(64, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(64, HIDDEN, generator=g))
        self.layers = torch.nn.ModuleList(
            Layer(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5, rank, world, p) for p in ROUTES)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return h


def _parallel_state(ctx: RankContext):
    install_flashinfer()          # before vLLM imports its FlashInfer modules
    os.environ.setdefault("TPPROBE_VLLM_ALLREDUCE", "gloo")      # vLLM's CPU communicator without shared memory
    from tpprobe.engines.vllm import cpu_mode, tiny

    cpu_mode.enable()
    config = tiny.hf_config("llama", 2)
    folder = tempfile.mkdtemp(prefix="tpprobe-vllm-gpu-paths-")
    config.save_pretrained(folder)
    vc = cpu_mode.make_config(folder, ctx.world_size, torch.float32, 64)
    shutil.rmtree(folder, ignore_errors=True)
    cpu_mode.publish_parallel_state(vc, ctx.rank, ctx.world_size, ctx.local_rank)
    # vLLM's own code on the stand-in FlashInfer: the fused op is defined and registered by vLLM's statements
    import vllm.distributed.device_communicators.flashinfer_all_reduce  # noqa: F401
    load_fused_op()
    from vllm.distributed.parallel_state import get_tp_group

    return vc, get_tp_group()


def build(ctx: RankContext) -> ProbeTarget:
    """Every GPU path of vLLM's CudaCommunicator, one per layer (ROUTES), healthy."""
    from tpprobe.engines.vllm.audit import vllm_extensions

    vc, tp = _parallel_state(ctx)
    cc = cuda_communicator(tp)
    tp.device_communicator = cc       # what vLLM's GPU worker has at this place
    model = PathsModel(ctx.rank, ctx.world_size).eval()
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: route(cc, m.proj.path, tp))
    ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(SEED))

    def forward():
        from vllm.config import set_current_vllm_config

        with torch.no_grad(), set_current_vllm_config(vc):
            return model(ids)

    return ProbeTarget(model=model, forward=forward, input_ids=ids, num_layers=len(ROUTES), hidden_size=HIDDEN,
                       dtype=torch.float32, tap_extensions=vllm_extensions(),
                       info={"vllm device communicator": "CudaCommunicator, its GPU paths on CPU over gloo "
                                                         "(tests/zoo/vllm_gpu_paths.py)",
                             "vllm paths by layer": ",".join(ROUTES)})


def build_wrong_sums(ctx: RankContext) -> ProbeTarget:
    """The same, every substituted kernel returning the sum scaled by 2 (custom all-reduce, so the compiled
    form's layer too; symmetric memory, pynccl, FlashInfer, the fused op). vLLM's last resort,
    `torch.distributed.all_reduce(out, group=device_group)`, is torch's own call: it stays right."""
    WRONG.update({p: "scaled" for p in ("custom", "symm_mem", "pynccl", "flashinfer", "fused")})
    return build(ctx)
