"""The direct launch: a compiled kernel's launcher called with integer addresses, opt-in and version-pinned.

The first launch of a shape goes through ``JITFunction.run`` (which compiles, or finds the binary,
and returns Triton's CompiledKernel); later ones call that CompiledKernel's launcher directly with
integer addresses, as ``JITFunction.run`` itself does once it has bound the arguments: the binder,
the specialisation key and the cache look-up it repeats per call are what they were at the first
launch, because the integer arguments are the same and every pointer is 16-byte aligned.  The
launcher's calling convention is Triton's own, not its API: the direct launch is taken only on the
Triton releases ``config.knobs.FAST_PATHS["launch"]`` names, with no launch hook (a profiler's), not
under the CPU interpreter and not with TPPROBE_FP_JIT set.  Otherwise every launch is
``JITFunction.run``.  docs/benchmarks.md has what it saves (bench/launch_path.py)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import triton

from ...config.knobs import fast_path_refused
from .kernels import INTERP


@dataclass
class DirectLaunch:
    """A compiled kernel's launch with the arguments it needs besides the kernel's own."""
    launch: Any                  # the C launch (Triton 3.6) or the launcher
    function: Any                # the CUBIN function handle
    middle: tuple                # the arguments between the function and the kernel's own
    tail: tuple                  # the constexprs JITFunction.run appends (constexpr_args)
    compiled: Any                # the CompiledKernel, held: its module stays loaded


def _no_hook(h) -> bool:
    # Triton 3.x's launch hooks are HookChains, empty unless a profiler (proton) added one
    return h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls)


def refused(version: str = "") -> str:
    """Why launches go through JITFunction.run ("" when the direct launch is taken); ``version``:
    Triton's, the installed one unless given."""
    if INTERP:
        return "the CPU interpreter"
    why = fast_path_refused("launch", version or triton.__version__)
    if why:
        return why
    try:
        rt = triton.knobs.runtime
        return "" if _no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook) else "a launch hook is set"
    except AttributeError:       # a Triton without knobs: keep JITFunction.run
        return "no triton.knobs"


def direct_launch_ok(version: str = "") -> bool:
    return not refused(version)


# Triton 3.6's CudaLauncher.__call__ (names it reads, exactly): it allocates the global and
# profile scratch (neither kernel here has any), then calls its C `launch` with the cooperative-grid
# and PDL flags and the two scratch pointers put before the rest of its arguments.
LAUNCHER_3_6 = frozenset(("_allocation", "_allocator", "_profile_allocator", "global_scratch_size",
                          "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "launch",
                          "launch_cooperative_grid", "launch_pdl"))


def launch_of(ck):
    """(launch, the arguments between the function and the kernel's own) for a compiled kernel:
    Triton 3.6's C launch itself when its launcher is exactly that form and needs no scratch (its
    Python ``__call__`` is a frame and two closures per launch), else the launcher, as
    ``JITFunction.run`` calls it."""
    run, meta = ck.run, ck.packed_metadata
    code = getattr(getattr(type(run), "__call__", None), "__code__", None)
    raw = getattr(run, "launch", None)
    if code is not None and raw is not None and set(code.co_names) == LAUNCHER_3_6 \
            and code.co_argcount == 6 and code.co_flags & inspect.CO_VARARGS \
            and code.co_varnames[:6] == ("self", "gridX", "gridY", "gridZ", "stream", "function") \
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
        return raw, (run.launch_cooperative_grid, run.launch_pdl, None, None, meta, None, None, None)
    return run, (meta, None, None, None)


def launchable(ck) -> bool:
    return all(hasattr(ck, a) for a in ("run", "function", "packed_metadata"))


def direct_launch(kern, ck, npos: int, kw: dict) -> DirectLaunch:
    launch, middle = launch_of(ck)
    return DirectLaunch(launch, ck.function, middle, constexpr_args(kern, npos, kw), ck)


def constexpr_args(kern, npos: int, kw: dict) -> tuple:
    """The values after the npos positional arguments of a launch, in the kernel's parameter
    order (its constexprs, from kw or their defaults): what JITFunction.run hands the launcher."""
    if INTERP:
        return ()
    params = inspect.signature(kern.fn).parameters
    return tuple(kw[n] if n in kw else params[n].default for n in kern.arg_names[npos:])
