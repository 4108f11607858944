"""CUDA helpers with no tpprobe imports: the current stream, kept per stream (`current_stream`)."""
from __future__ import annotations

import torch

# process-wide by nature: a Stream object is a handle on a CUDA stream of this process, the same for every
# Tap and run in it; it carries no run state
_STREAMS: dict = {}
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)


def current_stream(device_index: int):
    """torch.cuda.current_stream(device_index), the Stream object kept per stream: one C call per
    collective instead of torch's Python lookup of the device and a new Stream (its cost: docs/benchmarks.md)."""
    if _GET_STREAM is None:
        return torch.cuda.current_stream(device_index)
    key = _GET_STREAM(device_index)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return s
