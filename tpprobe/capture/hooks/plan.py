"""What the Tap finds from a model's structure, kept per model while the structure is unchanged (`PlanCache`).

A Tap per forward would otherwise walk `named_modules` again at every install (docs/benchmarks.md).
A plan is used again only while the model's structure is the same: the same child modules under
the same names in every module, the same parameter and buffer objects (a tensor replaced or added
anywhere), and no module, parameter or buffer registered while a Tap was entered (PyTorch's global
registration hooks count them; `Registrations` holds them from the first Tap's enter to the last
Tap's exit, so importing tpprobe changes nothing).  Not seen: a parameter's `.data` replaced."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from .. import discover
from ..audit import holds_inference_tensors

_REGISTRATION_HOOKS = ("register_module_module_registration_hook", "register_module_parameter_registration_hook",
                       "register_module_buffer_registration_hook")


class Registrations:
    """PyTorch's three global registration hooks, counting registrations while any Tap is entered."""

    def __init__(self):
        self.taps = 0                 # Taps entered and not yet exited
        self.generation = 0           # registrations seen while installed
        self.handles: list = []
        self.lock = threading.Lock()

    def _bump(self, *_):
        self.generation += 1

    def acquire(self) -> None:
        with self.lock:
            if self.taps == 0:
                mm = torch.nn.modules.module
                self.handles = [getattr(mm, name)(self._bump) for name in _REGISTRATION_HOOKS]
            self.taps += 1

    def release(self) -> None:
        with self.lock:
            self.taps -= 1
            if self.taps == 0:
                for h in self.handles:
                    h.remove()
                self.handles = []

    def installed(self) -> bool:
        return bool(self.handles)


# process-wide by nature: torch's registration hooks are global; installed only while a Tap is entered
REGISTRATIONS = Registrations()


class Plan:
    __slots__ = ("layer_how", "layer_list", "layers", "embed", "candidates", "subs", "known", "inference", "stamp",
                 "mods", "found", "cached", "generation", "hooked")


def _stamp(model, mods) -> list:
    """Every module's children by name and identity (the plan holds them), then its parameter count,
    its parameters' and buffers' ids; flat, one -1 after each module (this runs at every Tap)."""
    out: list = []
    for m in (model, *mods):
        d = m.__dict__
        try:
            children, params, buffers = d["_modules"], d["_parameters"], d["_buffers"]
        except KeyError:            # kept elsewhere than the instance (a scripted module)
            children, params, buffers = m._modules, m._parameters, m._buffers
        if children:
            out += children.items()
        out.append(len(params))
        if params:
            out += map(id, params.values())
        if buffers:
            out += map(id, buffers.values())
        out.append(-1)
    return out


class PlanCache:
    """Plans per model object (weakly) and (layers, embed) spec.  ``reset()`` forgets them all."""

    def __init__(self, registrations: Registrations = REGISTRATIONS):
        self.plans: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.registrations = registrations

    def reset(self) -> None:
        self.plans.clear()

    def plan(self, model: torch.nn.Module, layer_spec: Optional[str], embed_spec: Optional[str]) -> Plan:
        try:
            per = self.plans.setdefault(model, {})
        except TypeError:               # not weakly referenceable: no cache
            per = {}
        plan = per.get((layer_spec, embed_spec))
        gen = self.registrations.generation
        if plan is not None and plan.generation == gen and plan.stamp == _stamp(model, plan.mods):
            return _root(plan, model)
        plan = _build(model, layer_spec, embed_spec)
        plan.generation = gen
        per[(layer_spec, embed_spec)] = plan
        return _root(plan, model)


def _build(model: torch.nn.Module, layer_spec: Optional[str], embed_spec: Optional[str]) -> Plan:
    plan = Plan()
    plan.found = None        # the candidate an earlier Tap found to be the embedding (its name)
    plan.cached = plan
    plan.layer_how, plan.layer_list, plan.layers = discover.layer_list(model, layer_spec)
    plan.embed = discover.embedding(model, embed_spec) if embed_spec else None
    plan.candidates = [] if embed_spec else discover.candidates(model, plan.layers, plan.layer_list)
    seen: set[int] = set()
    plan.subs = []
    for idx, name, m in plan.layers:
        subs = []
        for sub_name, sub in m.named_modules():
            if sub is m or id(sub) in seen:   # a module shared by layers (SGLang's rope) once
                continue
            seen.add(id(sub))
            kind = "row" if discover.is_row_parallel(sub) else "module"
            subs.append((kind, f"{name}.{sub_name}", sub))
        plan.subs.append((idx, name, m, subs))
    # what the collective audit names from the running module calls: the layers and every module
    # inside them (ids: the plan is used only while these modules are all alive, see _stamp)
    plan.known = {}
    for idx, name, m, subs in plan.subs:
        plan.known[id(m)] = (name, "layer", idx)
        for kind, sub_name, sub in subs:
            plan.known[id(sub)] = (sub_name, kind, idx)
    # the modules the Tap hooks besides the layers, per layer (built once here, not at every Tap): the
    # row-parallel ones (their outputs are noted) and layer 0's input norm (a capture point); the
    # others need no hook: a collective finds the modules it runs in from the frames
    first = plan.subs[0][0] if plan.subs else None
    plan.hooked = [[(kind, sub_name, sub) for kind, sub_name, sub in subs
                    if kind == "row" or idx == first and sub_name.endswith(".input_layernorm")]
                   for idx, _, _, subs in plan.subs]
    plan.inference = holds_inference_tensors(model)
    # the cache holds no reference to the model itself (it is the weak key): None stands for it
    plan.mods = [m for m in model.modules() if m is not model]
    plan.stamp = _stamp(model, plan.mods)
    plan.candidates = [(n, None if m is model else m) for n, m in plan.candidates]
    plan.embed = None if plan.embed is None else (plan.embed[0], None if plan.embed[1] is model else plan.embed[1])
    return plan


def _root(plan: Plan, model) -> Plan:
    """The plan with the model itself put back where the cache holds None."""
    out = Plan()
    for k in Plan.__slots__:
        setattr(out, k, getattr(plan, k))
    out.candidates = [(n, model if m is None else m) for n, m in plan.candidates]
    if plan.embed is not None and plan.embed[1] is None:
        out.embed = (plan.embed[0], model)
    return out


PLANS = PlanCache()   # per model object (weakly): a plan lives as long as its model; reset() forgets them
