"""One captured step of a live engine: the rank record and the run settings both plugins write.

The SGLang plugin (engines/sglang/plugin.py) and the vLLM plugin (engines/vllm/worker.py) differ in how
they hook the model and name their ranks; what they write per step is built here once: the kept
tensors under the byte budget (the packed aux first, then the token ids), the rank record with every
fingerprint and the aux slot match (capture/record.py), and the settings (formats/settings.py).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

import torch

from ..capture.points import AUX_PACKED, EMBED_OUT, INPUT_IDS
from ..capture.record import PROBE_SKETCH, RankRecord, rank_record
from ..formats.settings import run_settings

# this server process: when it first captured (UTC, first: the names sort by it), where, which process. In every
# step's settings, so a report over a capture folder that also holds an earlier server's steps tells them apart
# (tpprobe/cli/steps.py)
_RUN = f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}Z on {socket.gethostname()}, pid {os.getpid()}"


def step_record(tap, *, model, rank: int, world: int, input_ids: torch.Tensor, aux: Optional[torch.Tensor], budget,
                t_forward: float, extra: dict) -> RankRecord:
    """This rank's record of the step: every point's and all-reduce's fingerprint, the tensors the budget
    admits (`budget.admit`, asked before each copy), the whole aux tensor's layout, fingerprint and slot
    match (also when only its rows, or nothing, were kept); `extra`: the plugin's own facts."""
    started = time.time()
    kept_aux = None
    if aux is not None and budget.admit(AUX_PACKED, aux):
        kept_aux = (aux if tap.sample_rows is None else aux[:tap.sample_rows]).detach().clone()
    ids = input_ids.detach().clone() if budget.admit(INPUT_IDS, input_ids) else None
    config = getattr(model, "config", None)
    return rank_record(tap, rank=rank, world=world, input_ids=ids, model=model,
                       hidden=int(getattr(config, "hidden_size", 0) or 0), packed=kept_aux, aux=aux,
                       timings={"forward_s": t_forward}, device=input_ids.device, extra=extra,
                       fingerprints=PROBE_SKETCH, count_kept=True, record_started=started)


def step_settings(record: RankRecord, model, *, backend: str, tokens: int, mode: str, step: int, par: dict,
                  slots: tuple, extra: Optional[dict] = None) -> dict:
    """The step's run settings (the manifest's): the model's dtype as its embedding output had it,
    the slots the packed aux should hold (`slots`: expected points and ids by the engine's rule)."""
    fps = record.fingerprints or {}
    dtype = fps[EMBED_OUT]["dtype"] if EMBED_OUT in fps else next(iter(model.parameters())).dtype
    config = getattr(model, "config", None)
    return run_settings(world_size=record.world_size, backend=backend, dtype=dtype, layer_ids=slots[1],
                        num_layers=record.layers_hooked, hidden=record.hidden, tokens=tokens,
                        arch=str(getattr(config, "model_type", type(model).__name__)), model=type(model).__name__,
                        exchange="fingerprint (plugin)", slots=slots,
                        extra={**(extra or {}), "forward_mode": mode, "step": step, "dp_rank": par["dp_rank"],
                               "pp_rank": par["pp_rank"], "server run": _RUN})
