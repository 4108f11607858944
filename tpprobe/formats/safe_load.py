"""The one `.pt` reader: every torch.save file tpprobe opens goes through `torch_load` (weights_only=True).

torch.load(weights_only=True) refuses any pickle that would import or call something, so loading a
capture, a dumper record, a SpecForge sample or a draft checkpoint never executes code. This is the
only call of torch.load in the package (tests/ranks/test_loader.py holds it to that); callers turn its
errors into their own one-line CaptureError, naming the file and what they expected there.
"""
from __future__ import annotations

import warnings

import torch


def torch_load(src, mmap: bool = False, quiet: bool = False):
    """torch.load(src) on CPU with weights_only=True: plain tensors and containers, never code.
    mmap: map the file (its values are read from the page cache where they are used); quiet: silence
    torch's warnings (a legacy-format pickle), where the caller's error line says all there is."""
    kw = {"mmap": True} if mmap else {}
    if not quiet:
        return torch.load(src, map_location="cpu", weights_only=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(src, map_location="cpu", weights_only=True, **kw)


def refusal_reason(exc: BaseException) -> str:
    """What a weights-only load refused, in a few words, from torch's long UnpicklingError text:
    `loading it would call posix.system` (the global the file names), else the instruction it met."""
    import re
    text = str(exc)
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"loading it would call {m.group(1)}"
    m = re.search(r"Unsupported operand (\d+)", text)
    if m:
        return f"it holds a pickle instruction a weights-only load never runs (opcode {m.group(1)})"
    return "it holds objects a weights-only load does not build"


def refusal(path, exc: BaseException, verb: str = "refused") -> str:
    """The one line for a .pt file a weights-only load refused: the file, what it would do, the rule."""
    return (f"{path}: {verb}: {refusal_reason(exc)}; tpprobe loads .pt files with torch.load(weights_only=True) "
            f"only: tensors and plain containers, never code")
