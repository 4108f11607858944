"""Layout of the packed aux hidden state: present, in the model's dtype, contiguous, full width
(not a TP slice), a whole number of hidden-size slots."""
from __future__ import annotations

from typing import Optional

from ..capture.points import AUX_PACKED
from ..capture.schema import AuxLayout


def layout_verdict(width: Optional[int], aux: Optional[AuxLayout], dtype: Optional[str], ids, n_slots: int,
                   hidden: int, world: int) -> Optional[tuple]:
    """(kind, where, detail) for the first layout problem of one rank's packed aux (`aux`: its layout as the
    rank recorded it, None when it said none), or None."""
    aux = aux or AuxLayout()
    if width is None:
        return ("missing-capture", AUX_PACKED, "the model produced no packed aux hidden state "
                f"for ids {ids}")
    if aux.dtype and aux.dtype != dtype:
        return ("dtype-mismatch", AUX_PACKED, f"packed aux is {aux.dtype} where the "
                f"model runs {dtype}")
    if aux.contiguous is False:
        return ("layout-mismatch", AUX_PACKED, "packed aux is a non-contiguous view "
                f"(strides {aux.stride})")
    if world > 1 and width == n_slots * hidden // world and width != n_slots * hidden:
        return ("tp-sliced", AUX_PACKED, f"packed aux width is {width} = {n_slots} × "
                f"{hidden // world} (hidden {hidden} / tp {world}): each slot is a TP slice")
    if width % hidden:
        return ("layout-mismatch", AUX_PACKED, f"packed aux width {width} is not a multiple "
                f"of hidden {hidden}")
    return None
