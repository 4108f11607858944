"""Plain-tensor helpers with no tpprobe imports: a tensor's bytes (`tensor_bytes`)."""
from __future__ import annotations

import ctypes

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a plain tensor, in memory order of its contiguous CPU copy (no numpy)."""
    c = t.detach().to("cpu").contiguous()
    n = c.numel() * c.element_size()
    return ctypes.string_at(c.data_ptr(), n) if n else b""
