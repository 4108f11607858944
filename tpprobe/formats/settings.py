"""A run's settings, as manifest.json and report.json carry them: the one builder.

`tpprobe probe` (probe/prepare.py), both engine plugins (engines/step.py) and the GPU graph proof
(builtin/graph.py) describe their run through `run_settings`, so the checks and `tpprobe report` read
the same keys, in the same order, from every source.
"""
from __future__ import annotations

from typing import Optional

# the keys a run may give, in the order they are written; the caller's own keys (`extra`) follow, then
# the aux slots the checks expect (expected_points, expected_ids)
ORDER = ("world_size", "backend", "dtype", "layer_ids", "requested_layer_ids", "num_layers", "hidden", "tokens",
         "arch", "model", "inject", "exchange", "timeout_s", "model_packs_aux", "seed")


def run_settings(*, world_size: int, backend: str, dtype, layer_ids: list, num_layers: int, hidden, tokens: int,
                 arch: str, model: str, exchange: str, slots: Optional[tuple] = None, extra: Optional[dict] = None,
                 **optional) -> dict:
    """The settings of one run. `dtype`: a torch dtype or its name; `optional`: the other ORDER keys a
    source knows (the probe's requested ids, faults, timeout, seed); `extra`: the source's own facts (a
    model's info, a plugin's step and ranks); `slots`: (expected_points, expected_ids) of the packed aux."""
    unknown = sorted(set(optional) - set(ORDER))
    if unknown:
        raise TypeError(f"run_settings: unknown settings {unknown} (give them in extra)")
    given = dict(world_size=world_size, backend=backend, dtype=str(dtype).removeprefix("torch."), layer_ids=layer_ids,
                 num_layers=num_layers, hidden=hidden, tokens=tokens, arch=arch, model=model, exchange=exchange,
                 **optional)
    settings = {k: given[k] for k in ORDER if k in given}
    settings = {**settings, **(extra or {})}
    if slots is not None:
        settings["expected_points"], settings["expected_ids"] = slots
    return settings
