"""Scoped hooks: the Tap (tap.py), how it hooks a module (install.py, fast.py), its plan cache (plan.py).

Public names: `Tap`, `LAYER_EXTENSIONS`, `DeviceStalled`, `first_tensor`, `residual_stream`,
`running_modules`, `find_modules`, `PLANS` / `REGISTRATIONS` (their `reset`, `installed`)."""
from .collectives import DeviceStalled, running_modules
from .install import HookHandle, add_hooks
from .outputs import find_modules, first_tensor, is_owed, residual_stream
from .plan import PLANS, REGISTRATIONS, PlanCache, Registrations
from .tap import LAYER_EXTENSIONS, Tap

__all__ = ["LAYER_EXTENSIONS", "PLANS", "REGISTRATIONS", "DeviceStalled", "HookHandle", "PlanCache", "Registrations",
           "Tap", "add_hooks", "find_modules", "first_tensor", "is_owed", "residual_stream", "running_modules"]
