"""The fast paths through private torch / Triton internals are switches pinned to the releases
config/knobs.py FAST_PATHS names: on the installed torch the Tap's fast hooks are taken and record
exactly what torch's public hook API records (both run on the same real gloo ranks); a release
outside the range, or the knob, selects the public path.  And no global hook outlives the Taps:
PyTorch's module-registration hooks are held from the first Tap's enter to the last Tap's exit."""
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.ranks import ROOT, spawn
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin
from tpprobe.capture.hooks import PLANS, REGISTRATIONS, Tap, fast
from tpprobe.config.knobs import FAST_PATHS, release
from tpprobe.core.errors import UsageError
from tpprobe.core.target import RankContext

_GLOBAL = ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
           "_global_buffer_registration_hooks")


def _global_hooks() -> list:
    return [len(getattr(torch.nn.modules.module, n)) for n in _GLOBAL]


def _capture(rank, world, public: bool):
    if public:
        os.environ["TPPROBE_FAST_HOOKS"] = "0"
    else:
        os.environ.pop("TPPROBE_FAST_HOOKS", None)
    t = build_builtin(RankContext(rank, world, rank, torch.device("cpu"), "gloo"), BuiltinConfig(num_layers=3,
                                                                                                  tokens=5))
    out = []
    for _ in range(2):                   # the second Tap reuses the plan the first made
        with torch.no_grad(), Tap(t.model) as tap:
            t.forward()
        out.append({"path": tap.hooks_path, "order": tap.order,
                    "captures": {k: v.clone() for k, v in tap.captures.items()},
                    "records": [r.meta() for r in tap.allreduces],
                    "inputs": [None if r.inp is None else r.inp.clone() for r in tap.allreduces],
                    "coverage": tap.coverage(), "unreduced": tap.unreduced_rows()})
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in t.model.modules())
    wrappers_left = sum("forward" in m.__dict__ for m in t.model.modules())
    return {"taps": out, "left": (hooks_left, wrappers_left)}


def _both(rank, world):
    return {"fast": _capture(rank, world, public=False), "public": _capture(rank, world, public=True)}


def test_on_the_installed_torch_the_fast_hooks_are_taken_and_record_what_the_public_api_records():
    assert fast.refused() == "", f"torch {torch.__version__} is outside FAST_PATHS['hooks']: {fast.refused()}"
    res = spawn(_both, 2)
    for rank, r in res.items():
        fast_taps, public_taps = r["fast"]["taps"], r["public"]["taps"]
        assert [t["path"] for t in fast_taps] == ["fast", "fast"]
        assert [t["path"] for t in public_taps] == ["public (TPPROBE_FAST_HOOKS=0)"] * 2
        assert r["fast"]["left"] == r["public"]["left"] == (0, 0)
        for f, p in zip(fast_taps, public_taps):
            assert f["order"] == p["order"] and f["order"][:3] == ["embed.local", "embed.out", "layer.0.in_norm"]
            assert f["captures"].keys() == p["captures"].keys() and f["captures"]
            assert all(torch.equal(f["captures"][k], p["captures"][k]) for k in f["captures"]), rank
            assert f["records"] == p["records"] and len(f["records"]) == 7
            assert all(a is not None and torch.equal(a, b) for a, b in zip(f["inputs"], p["inputs"]))
            assert f["coverage"] == p["coverage"] and f["unreduced"] == p["unreduced"] == []


def test_a_release_outside_the_range_or_the_knob_selects_the_public_path(monkeypatch):
    spec = FAST_PATHS["hooks"]
    below = f"{spec.lowest[0]}.{spec.lowest[1] - 1}.0" if spec.lowest[1] else f"{spec.lowest[0] - 1}.99.0"
    above = f"{spec.below[0]}.{spec.below[1]}.0"
    assert release(torch.__version__) and spec.lowest <= release(torch.__version__) < spec.below
    for v in (below, above, "nightly"):
        assert fast.refused(v).startswith(f"torch {v} is outside"), v
    monkeypatch.setattr(torch, "__version__", above)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 128), torch.nn.ModuleList([torch.nn.Linear(128, 128)]))
    with Tap(model, audit=False) as tap:
        pass
    assert tap.hooks_path == f"public (torch {above} is outside {spec.lowest[0]}.{spec.lowest[1]} to " \
                             f"{spec.below[0]}.{spec.below[1]} (exclusive))"
    monkeypatch.setattr(torch, "__version__", f"{spec.lowest[0]}.{spec.lowest[1]}.0")
    assert fast.refused() == ""
    monkeypatch.setenv("TPPROBE_FAST_HOOKS", "0")
    assert fast.refused() == "TPPROBE_FAST_HOOKS=0"


def test_the_direct_triton_launch_is_taken_only_inside_its_range(monkeypatch):
    pytest.importorskip("triton")
    from tpprobe.fingerprint.triton import fastlaunch
    spec = FAST_PATHS["launch"]
    inside = f"{spec.lowest[0]}.{spec.lowest[1]}.0"
    monkeypatch.delenv("TPPROBE_FP_JIT", raising=False)
    assert fastlaunch.refused(inside) == "" and fastlaunch.direct_launch_ok(inside)
    for v in (f"{spec.below[0]}.{spec.below[1]}.0", "3.5.1"):
        assert fastlaunch.refused(v).startswith(f"triton {v} is outside") and not fastlaunch.direct_launch_ok(v)
    monkeypatch.setenv("TPPROBE_FP_JIT", "1")
    assert fastlaunch.refused(inside) == "TPPROBE_FP_JIT=1"


def _toy():
    return torch.nn.Sequential(torch.nn.Embedding(8, 128), torch.nn.ModuleList([torch.nn.Linear(128, 128)]))


def test_the_registration_hooks_are_held_from_the_first_taps_enter_to_the_last_taps_exit():
    base = _global_hooks()
    assert REGISTRATIONS.taps == 0 and not REGISTRATIONS.installed()
    a, b = _toy(), _toy()
    with Tap(a, audit=False):
        assert _global_hooks() == [n + 1 for n in base] and REGISTRATIONS.installed()
        with Tap(b, audit=False):
            assert _global_hooks() == [n + 1 for n in base] and REGISTRATIONS.taps == 2
        assert REGISTRATIONS.installed()           # the first Tap is still entered
        extra = torch.nn.Linear(2, 2)
        gen = REGISTRATIONS.generation
        a.add_module("extra", extra)               # seen while a Tap is entered
        assert REGISTRATIONS.generation == gen + 1
    assert _global_hooks() == base and REGISTRATIONS.taps == 0 and not REGISTRATIONS.installed()
    with pytest.raises(UsageError):                  # a Tap whose install fails still lets them go
        with Tap(a, layers="no.such.layers", audit=False):
            pass
    assert _global_hooks() == base and REGISTRATIONS.taps == 0


def test_a_plan_is_made_again_when_the_structure_changed_between_taps():
    """With no registration hook between Taps, the plan's stamp still sees a module replaced, a
    parameter replaced (same count) and a buffer added."""
    m = _toy()
    PLANS.reset()
    with Tap(m, audit=False) as t1:
        pass
    first = PLANS.plans[m][(None, None)]
    with Tap(m, audit=False):
        pass
    assert PLANS.plans[m][(None, None)] is first and t1.layer_indices == [0]
    for change in (lambda: m[1].__setitem__(0, torch.nn.Linear(128, 128)),
                   lambda: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(8, 128))),
                   lambda: m.register_buffer("b", torch.zeros(1))):
        before = PLANS.plans[m][(None, None)]
        change()
        with Tap(m, audit=False):
            pass
        assert PLANS.plans[m][(None, None)] is not before


def test_importing_tpprobe_registers_no_global_hook():
    code = ("import torch\n"
            "m = torch.nn.modules.module\n"
            f"names = {_GLOBAL!r}\n"
            "before = [len(getattr(m, n)) for n in names]\n"
            "import tpprobe.capture.hooks, tpprobe.probe.pipeline, tpprobe.capture.audit\n"
            "print(before == [len(getattr(m, n)) for n in names])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True"]
