"""The fingerprint launch in C (native.c): a queued fingerprint with no Python frame, where it can be built.

A checked decode forward queues one fingerprint per captured point and per collective's input and
output, each between the model's own ops, where every Python frame runs cold (docs/benchmarks.md).
`Taker` does what ``Deferred.__call__`` -> ``Batch.take`` -> ``Batch._launch`` do for a tensor whose
shape already has a launch entry, in C, on the same objects; `launch_later` launches the read's
queued ones in one C loop.  Everything else stays on the Python path, which also makes each shape's
first launch (through JITFunction.run) and, from that CompiledKernel, the entry's `Launch` (its
parameters laid out from Triton's own signature of the kernel).

It is taken where the direct launch is (fastlaunch.py: Triton 3.6's C launch, no launch hook, not
the interpreter) and the C source builds: Triton's own builder compiles it (the compiler, include
files and cache it builds its launchers with), once per process, at the first batch on a GPU.
The same module holds allreduce's door in C (`Door`: capture/audit/doors.py puts it in place once
the module is loaded).  TPPROBE_NATIVE=0 keeps both on the Python path; ``WHY`` says why it is not
taken."""
from __future__ import annotations

from importlib import resources
from typing import Any, Optional

from ...config.knobs import knob
from . import fastlaunch

NATIVE: Any = None          # the built module, once loaded
WHY = ""                    # why not ("" while untried or loaded)
_TRIED = False
_STREAM: Any = None         # the driver's current-stream getter (device index -> handle)

_INT_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}


def load() -> Any:
    """The built module, building it at the first call (None, with ``WHY`` set, where it is not taken)."""
    global NATIVE, WHY, _TRIED
    if _TRIED:
        return NATIVE
    _TRIED = True
    if knob("TPPROBE_NATIVE") == "0":
        WHY = "TPPROBE_NATIVE=0"
        return None
    why = fastlaunch.refused()
    if why:
        WHY = f"no direct launch ({why})"
        return None
    try:
        from triton.backends.nvidia.driver import include_dirs, libraries, library_dirs
        from triton.runtime.build import compile_module_from_src
        src = resources.files(__package__).joinpath("native.c").read_text()
        NATIVE = compile_module_from_src(src, "tpprobe_native", library_dirs(), include_dirs, libraries)
    except Exception as e:        # noqa: BLE001 - no compiler, no headers: the Python path, said once
        WHY = f"native.c did not build ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        NATIVE = None
    return NATIVE


def launch_for(e, ck, launch) -> Optional[Any]:
    """The entry's `Launch` from its CompiledKernel, or None where the C launch would not be exactly
    Triton's: another launcher than 3.6's C launch, cooperative or PDL launches, clusters, scratch,
    a parameter that is not a pointer or an integer, or torch-side row flags. ``launch``: what
    fastlaunch.launch_of chose for ck."""
    if NATIVE is None or e.extra or e.why:
        return None
    run = ck.run
    if launch is run:                                # not Triton 3.6's C launch
        return None
    num_warps, num_ctas, shared = ck.packed_metadata
    if num_ctas != 1 or run.launch_cooperative_grid or run.launch_pdl:
        return None
    sig = list(getattr(ck.src, "signature", {}).values())
    values = [0, e.aptr, 0, 0, 0, *e.tail]          # the tensor and the three slot addresses: per launch
    if len(sig) != len(values) or not all(isinstance(s, str) and s.startswith("*") for s in sig[:5]):
        return None
    sizes, vals = [], []
    for ty, v in zip(sig, values):
        if ty == "constexpr":
            continue
        n = 8 if ty.startswith("*") else _INT_BYTES.get(ty)
        if n is None or not isinstance(v, int):
            return None
        sizes.append(n)
        vals.append(v)
    sizes += [8, 8]                                  # Triton's global and profile scratch: none
    vals += [0, 0]
    return NATIVE.Launch(ck.function, e.grid, 32 * num_warps, shared, e.words, e.fbyte, e.tbyte, sizes, vals)


def taker(deferred, slow, item) -> Optional[Any]:
    """A `Taker` for a Deferred (its call and ``later``), where the module is loaded."""
    global _STREAM
    if NATIVE is None:
        return None
    if _STREAM is None:
        import triton
        _STREAM = triton.runtime.driver.active.get_current_stream
    return NATIVE.Taker(deferred, slow, _STREAM, item)
