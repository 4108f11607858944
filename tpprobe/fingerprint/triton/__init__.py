"""Fused Triton fingerprints for CUDA tensors (bf16 / fp16 / fp32): kernels, plan, batch, combine, launch.

Imported lazily (triton is optional): ``fingerprint.reference.Deferred`` makes a `Batch` at the
first CUDA tensor of a forward."""
from .batch import Batch, Entry, Item, fingerprint_batch, launch
from .combine import combine_call, combine_many, combine_one
from .fastlaunch import constexpr_args, direct_launch_ok, launch_of
from .kernels import DESC, RES
from .plan import (buffer_words, buffers, calls, device_cc, launch_one, padded_k, plan, plan_one, sign_table,
                   split_buffer, supported, tuning, unsupported_reason)
from .state import STATE, State

__all__ = ["Batch", "DESC", "Entry", "Item", "RES", "STATE", "State", "buffer_words", "buffers", "calls",
           "combine_call", "combine_many", "combine_one", "constexpr_args", "device_cc", "direct_launch_ok",
           "fingerprint_batch", "launch", "launch_of", "launch_one", "padded_k", "plan", "plan_one", "sign_table",
           "split_buffer", "supported", "tuning", "unsupported_reason"]
