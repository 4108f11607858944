"""SpecForge EAGLE-3 offline training dumps: read one sample safely, write one from a capture.

The format (SpecForge `scripts/prepare_hidden_states.py`, read back by
`specforge/data/preprocessing.py` `OfflineEagle3Dataset`): one `torch.save` file per sample,
`<output-path>/rows_<start>-<end>/data_<idx>.ckpt` (also `.ckpt.gz`), holding a dict

  input_ids         int64 [tokens]              the tokenized sample (`row["input_ids"].view(-1)`)
  loss_mask         int   [tokens]              1 where the draft is trained (assistant turns)
  hidden_state      [1, tokens, hidden]         the target model's last hidden state
  aux_hidden_state  [1, tokens, K * hidden]     the packed EAGLE-3 aux hidden states (only with
                                                `--enable-aux-hidden-states`), the slots in the
                                                order SGLang captured them

SpecForge itself loads these with `weights_only=False`; tpprobe loads them with
`torch.load(weights_only=True)` only, so a file whose unpickling would run code is refused.
"""
from __future__ import annotations

import gzip
import io
import pickle
import zipfile
from pathlib import Path
from typing import Optional

import torch

from .safe_load import torch_load
from ..core.errors import CaptureError

KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
EXPECTED = ("a SpecForge EAGLE-3 sample (a dict with input_ids, loss_mask, hidden_state, aux_hidden_state) "
            "or a single packed [tokens, K*hidden] tensor")


def safe_torch_load(path: Path):
    """torch.load with weights_only=True (plain tensors and containers only); .gz is unpacked first."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                src = io.BytesIO(f.read())
        else:
            src = str(path)
        return torch_load(src, quiet=True)      # torch warns on legacy pickles; the error below says it all
    except pickle.UnpicklingError as e:
        from .safe_load import refusal
        raise CaptureError(refusal(path, e))
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, gzip.BadGzipFile, KeyError,
            AttributeError, TypeError, IndexError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"{path}: not a readable torch.save file ({msg[:160]}); expected {EXPECTED}")


def _batchless(path: Path, key: str, t, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CaptureError(f"{path}: '{key}' is a {type(t).__name__}, expected a tensor")
    if t.dim() == dims + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != dims:
        want = "[tokens]" if dims == 1 else "[1, tokens, width] or [tokens, width]"
        raise CaptureError(f"{path}: '{key}' has shape {list(t.shape)}, expected {want}")
    return t


def parse_sample(path: Path, data: dict) -> dict:
    """Validate a loaded SpecForge sample dict; return its tensors without the batch dimension."""
    if "aux_hidden_state" not in data:
        have = ", ".join(map(str, list(data)[:8]))
        raise CaptureError(f"{path}: no 'aux_hidden_state' (keys: {have}); a SpecForge sample written "
                           f"without --enable-aux-hidden-states has no EAGLE-3 slots to compare")
    out = {"aux_hidden_state": _batchless(path, "aux_hidden_state", data["aux_hidden_state"], 2)}
    if not out["aux_hidden_state"].dtype.is_floating_point:
        raise CaptureError(f"{path}: 'aux_hidden_state' is {out['aux_hidden_state'].dtype}, expected a float tensor")
    for k, dims in (("input_ids", 1), ("loss_mask", 1), ("hidden_state", 2)):
        if data.get(k) is not None:
            out[k] = _batchless(path, k, data[k], dims)
    T = out["aux_hidden_state"].shape[0]
    for k in ("input_ids", "loss_mask", "hidden_state"):
        if k in out and out[k].shape[0] != T:
            raise CaptureError(f"{path}: '{k}' covers {out[k].shape[0]} tokens but aux_hidden_state "
                               f"{T}; the sample is inconsistent")
    if "input_ids" in out and (out["input_ids"].dtype.is_floating_point or out["input_ids"].dtype == torch.bool):
        raise CaptureError(f"{path}: 'input_ids' is {out['input_ids'].dtype}, expected integer token ids")
    return out


def read_sample(path) -> dict:
    path = Path(path)
    data = safe_torch_load(path)
    if not isinstance(data, dict):
        raise CaptureError(f"{path}: holds a {type(data).__name__}, expected {EXPECTED}")
    return parse_sample(path, data)


def write_sample(path, input_ids: torch.Tensor, aux_hidden_state: torch.Tensor,
                 hidden_state: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None) -> Path:
    """One sample exactly as SpecForge's prepare_hidden_states.py saves it (batch dim on the states)."""
    path = Path(path)
    from .capture_dir import make_file_folder
    make_file_folder(path, "sample")
    ids = input_ids.reshape(-1).to(torch.long).cpu()
    data = {"input_ids": ids,
            "loss_mask": (loss_mask if loss_mask is not None else torch.ones_like(ids)).reshape(-1).cpu()}
    if hidden_state is not None:
        data["hidden_state"] = hidden_state.detach().clone().reshape(1, *hidden_state.shape[-2:]).cpu()
    data["aux_hidden_state"] = aux_hidden_state.detach().clone().reshape(1, *aux_hidden_state.shape[-2:]).cpu()
    torch.save(data, str(path))
    return path


def sample_from_capture(capture_dir, out_path, rank: int = 0) -> Path:
    """A SpecForge-format sample from a tpprobe capture: its packed aux tensor and input_ids.

    hidden_state is the last captured layer's residual stream: the capture holds no final-norm
    output, so it is a stand-in (tpprobe diff compares aux_hidden_state only)."""
    from .capture_dir import check_file_path, load_run
    from ..capture.points import AUX_PACKED, INPUT_IDS, stream_order
    check_file_path(Path(out_path), "sample")   # before any work
    run = load_run(capture_dir)
    if rank not in run.records:
        raise CaptureError(f"{capture_dir}: rank {rank} not readable (have {sorted(run.records)})")
    t = run.records[rank].tensors
    if AUX_PACKED not in t or INPUT_IDS not in t:
        raise CaptureError(f"{capture_dir}: rank {rank} has no aux.packed / input_ids to write a sample from")
    order = stream_order(t)
    return write_sample(out_path, t[INPUT_IDS], t[AUX_PACKED], t[order[-1]] if order else None)
