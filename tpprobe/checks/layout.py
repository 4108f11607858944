"""Layout of the packed aux hidden state: present, in the model's dtype, contiguous, full width
(not a TP slice), a whole number of hidden-size slots."""
from __future__ import annotations

from typing import Optional

from ..capture.points import AUX_PACKED


def layout_verdict(width: Optional[int], aux_meta: dict, dtype: Optional[str], ids, n_slots: int, hidden: int,
                   world: int) -> Optional[tuple]:
    """(kind, where, detail) for the first layout problem of one rank's packed aux, or None."""
    if width is None:
        return ("missing-capture", AUX_PACKED, "the model produced no packed aux hidden state "
                f"for ids {ids}")
    if aux_meta.get("dtype") and aux_meta["dtype"] != dtype:
        return ("dtype-mismatch", AUX_PACKED, f"packed aux is {aux_meta['dtype']} where the "
                f"model runs {dtype}")
    if aux_meta.get("contiguous") is False:
        return ("layout-mismatch", AUX_PACKED, "packed aux is a non-contiguous view "
                f"(strides {aux_meta.get('stride')})")
    if world > 1 and width == n_slots * hidden // world and width != n_slots * hidden:
        return ("tp-sliced", AUX_PACKED, f"packed aux width is {width} = {n_slots} × "
                f"{hidden // world} (hidden {hidden} / tp {world}): each slot is a TP slice")
    if width % hidden:
        return ("layout-mismatch", AUX_PACKED, f"packed aux width {width} is not a multiple "
                f"of hidden {hidden}")
    return None
