"""Triton's CPU interpreter (TRITON_INTERPRET=1) as the fingerprint tests and benches use it.

Triton 3.9's interpreter gives a scalar comparison the int32 type (its data stays bool), so a
scalar mask splats to an int32 array and tl.load refuses it ("mask has unsupported dtype"); the
compiler keeps such a mask i1.  ``install()`` splats a scalar bool as a bool: the interpreter's
own bug, not the kernel's (the kernels' `_ld` loads a tile with a scalar mask)."""
import numpy as np


def install() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interp

    splat = interp.InterpreterBuilder.create_splat
    if getattr(splat, "_bool_kept", False):
        return

    def create_splat(self, ret_ty, arg):
        if not isinstance(arg.dtype, tl.block_type) and arg.data.dtype == np.bool_:
            return interp.TensorHandle(np.full(ret_ty.shape, arg.data, dtype=np.bool_), tl.int1)
        return splat(self, ret_ty, arg)

    create_splat._bool_kept = True
    interp.InterpreterBuilder.create_splat = create_splat
