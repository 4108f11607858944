"""vLLM's `extract_hidden_states` output: one safetensors file per request (vLLM PR #33736).

vLLM 0.32.0 writes it from `ExampleHiddenStatesConnector._write_tensors` (vllm/distributed/kv_transfer/
kv_connector/v1/example_hidden_states_connector.py) with safetensors' `save_file`, TP rank 0 only, at
`{shared_storage_path}/{req_id}.safetensors` (a companion `.lock` beside it while the write runs):

  hidden_states  [tokens, K, hidden]  the K aux hidden states the target captured
                 (`torch.stack(target_hidden_states, dim=1)`: the slots in vLLM's order, ascending id;
                 id k = HF hidden_states[k], ids from the draft config's `eagle_aux_hidden_state_layer_ids`)
  token_ids      [tokens]             the prompt's token ids (the request's tokens less the last sampled one)

`parse` turns it into tpprobe's packed [tokens, K*hidden] view, slot j = hidden_states[:, j, :].
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import CaptureError

KEYS = ("hidden_states", "token_ids")
EXPECTED = "vLLM's extract_hidden_states file (hidden_states [tokens, K, hidden] and token_ids [tokens])"


def is_vllm_hidden(tensors: dict) -> bool:
    return set(KEYS) <= set(tensors)


def parse(path: Path, tensors: dict) -> dict:
    """{'packed': [tokens, K*hidden], 'input_ids': [tokens], 'hidden': H, 'slots': K}; CaptureError on a
    file that is not what vLLM writes."""
    hs, ids = tensors["hidden_states"], tensors["token_ids"]
    if not hs.dtype.is_floating_point or hs.dim() != 3:
        raise CaptureError(f"{path}: hidden_states is {str(hs.dtype).replace('torch.', '')} {list(hs.shape)}, "
                           f"expected {EXPECTED}")
    if ids.dim() != 1 or ids.dtype.is_floating_point:
        raise CaptureError(f"{path}: token_ids is {str(ids.dtype).replace('torch.', '')} {list(ids.shape)}, "
                           f"expected {EXPECTED}")
    T, K, H = hs.shape
    if ids.numel() and ids.numel() != T:
        raise CaptureError(f"{path}: {T} tokens of hidden_states but {ids.numel()} token_ids; expected {EXPECTED}")
    return {"packed": hs.reshape(T, K * H), "input_ids": ids.to(torch.long) if ids.numel() else None,
            "hidden": int(H), "slots": int(K)}


def to_tensors(slots: list[torch.Tensor], token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dict vLLM's writer saves, from per-slot [tokens, hidden] tensors (slot order = vLLM's)."""
    return {"hidden_states": torch.stack([s.contiguous() for s in slots], dim=1).contiguous(),
            "token_ids": token_ids.detach().to(torch.long).cpu().clone()}
