"""The scoped hooks: what the Tap records on real gloo ranks, and that it always cleans up."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ranks import ROOT, spawn
from tpprobe.capture.hooks import Tap
from tpprobe.engines.builtin.model import BuiltinConfig, build_builtin
from tpprobe.core.target import RankContext


def _target(rank, world):
    ctx = RankContext(rank, world, rank, torch.device("cpu"), "gloo")
    return build_builtin(ctx, BuiltinConfig(num_layers=3, tokens=5))


def _audit(rank, world):
    t = _target(rank, world)
    with torch.no_grad(), Tap(t.model) as tap:
        t.forward()
        layer0 = next(repr(h) for h in tap.handles if h.kind == "layer")
    return {"records": [(a.where, a.source, a.group_size, a.shape) for a in tap.allreduces],
            "order": tap.order, "handles": [f"<embed {tap.embed_name}>", layer0], "unreduced": tap.unreduced_rows(),
            "coverage": tap.coverage()}


def test_every_allreduce_is_attributed_to_its_layer_and_row_parallel_module():
    res = spawn(_audit, 2)[0]
    assert res["records"][0] == ("embed", None, 2, (5, 64))
    for k in range(3):
        assert res["records"][1 + 2 * k][:2] == (f"layer.{k}", f"layers.{k}.self_attn.o_proj")
        assert res["records"][2 + 2 * k][:2] == (f"layer.{k}", f"layers.{k}.mlp.down_proj")
    assert res["unreduced"] == []
    assert res["order"][:3] == ["embed.local", "embed.out", "layer.0.in_norm"]
    assert res["handles"] == ["<embed embed_tokens>", "<layer[0] layers.0>"]
    cov = res["coverage"]      # found from structure, not from class names
    assert (cov["embed"], cov["embed_how"], cov["layer_list"], cov["layers_found"]) == ("embed_tokens", "structure",
                                                                                        "layers", 3)
    assert cov["paths"] == {"c10d.allreduce_": 7} and cov["unreadable_paths"] == {}


def _raises(rank, world):
    t = _target(rank, world)
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    orig = dist.all_reduce
    t.model.layers[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with torch.no_grad(), Tap(t.model):
            t.forward()
    except RuntimeError:
        pass
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in t.model.modules())
    wrappers_left = sum("forward" in m.__dict__ for m in t.model.modules())
    return {"restored": dist.all_reduce is orig and _get_current_dispatch_mode() is None, "hooks_left": hooks_left,
            "wrappers_left": wrappers_left}


def test_hooks_and_the_collective_audit_are_removed_when_the_forward_raises():
    res = spawn(_raises, 2)
    for r in res.values():
        assert r["restored"]
        assert r["hooks_left"] == 1          # only the test's own pre-hook remains
        assert r["wrappers_left"] == 0       # no module keeps the Tap's wrapper around its forward


def _budgeted(rank, world):
    """admit(name, t) is asked before each copy; refused points are never copied (their tensors
    stay the model's); sample_rows keeps the first rows only."""
    ctx = RankContext(rank, world, rank, torch.device("cpu"), "gloo")
    t = build_builtin(ctx, BuiltinConfig(num_layers=3, tokens=5, layer_ids=[1]))   # the model clones nothing
    asked, copied = [], []
    orig_clone = torch.Tensor.clone

    def admit(name, x):
        asked.append((name, tuple(x.shape), len(copied)))
        return name in ("embed.out", "layer.1.out")

    def counting_clone(x, *a, **k):
        copied.append(tuple(x.shape))
        return orig_clone(x, *a, **k)

    torch.Tensor.clone = counting_clone
    try:
        with torch.no_grad(), Tap(t.model, keep=lambda n: n != "layer.2.out", admit=admit, sample_rows=2,
                                  keep_allreduce_tensors=False) as tap:
            t.forward()
    finally:
        torch.Tensor.clone = orig_clone
    return {"asked": [a[0] for a in asked], "kept": {n: tuple(v.shape) for n, v in tap.captures.items()},
            "copies_before_each_ask": [a[2] for a in asked], "copies": copied}


def test_a_budget_is_asked_before_any_copy_and_refused_points_are_not_copied():
    res = spawn(_budgeted, 2)[0]
    # layer.2.out is not a kept point: never asked; the embedding's local share is refused
    assert res["asked"] == ["embed.local", "embed.out", "layer.0.in_norm", "layer.0.out", "layer.1.out"]
    assert res["kept"] == {"embed.out": (2, 64), "layer.1.out": (2, 64)}
    # each ask happens before its copy: copies so far = admitted points before it (the layer stream
    # h + r the Tap forms is not a clone); the only clones are the two admitted 2-row samples
    assert res["copies"] == [(2, 64), (2, 64)]
    assert res["copies_before_each_ask"] == [0, 0, 1, 1, 1]


def _audit_files() -> set:
    """The source files of the audit's package (capture/audit/): the frames the profiles count."""
    from pathlib import Path

    import tpprobe.capture.audit as audit
    return {str(p) for p in Path(audit.__file__).parent.glob("*.py")}


def _kernel_doors(rank, world):
    """The audit's two paths on real ranks (capture/audit/): the kernel path enters audit code
    once per collective and never for an aten op; it records only its own thread's collectives;
    under inference mode, or for a model holding inference tensors, the dispatch mode records the
    same; an op defined after the first audit is picked up; backward through a functional
    collective still works with the kernels registered."""
    import sys
    import threading

    import torch.distributed._functional_collectives as funcol

    from tpprobe.capture import audit

    t = _target(rank, world)
    calls = []
    orig = audit.Audit.dispatch

    def counted(self, func, args, kwargs):
        calls.append(func._name)
        return orig(self, func, args, kwargs)

    audit.Audit.dispatch = counted
    recs = lambda tap: [(a.where, a.source, a.group_size, a.shape, a.checked, a.meta()["path"])  # noqa: E731
                        for a in tap.allreduces]
    out = {}
    entered = []                     # every Python frame of capture/audit/ the forward enters
    files = _audit_files()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            entered.append(frame.f_code.co_name)

    def profiled():                  # one forward under a Tap, every audit frame it enters counted
        entered.clear()
        with torch.no_grad(), Tap(t.model) as tap:
            sys.setprofile(prof)
            try:
                t.forward()
            finally:
                sys.setprofile(None)
        return tap

    tap = profiled()
    out["kernel"] = (tap.auditor.path, recs(tap), list(calls))
    out["entered"] = {n: entered.count(n) for n in ("door", "k", "__torch_dispatch__", "counted")}
    calls.clear()
    # the same forward with ProcessGroup's doors closed: the dispatcher kernel records the same
    audit.set_doors(False)
    try:
        tap = profiled()
    finally:
        audit.set_doors(True)
    out["kernel_only"] = (tap.auditor.path, recs(tap), list(calls),
                          {n: entered.count(n) for n in ("door", "k", "__torch_dispatch__")})
    calls.clear()
    with torch.no_grad(), Tap(t.model) as tap:        # another thread's all-reduce: not this forward's
        th = threading.Thread(target=lambda: dist.all_reduce(torch.ones(3)))
        th.start()
        th.join()
        t.forward()
    out["thread"] = (tap.auditor.path, recs(tap), len(calls))
    calls.clear()
    with torch.inference_mode(), Tap(t.model) as tap:
        t.forward()
    out["inference"] = (tap.auditor.path, recs(tap))
    with torch.inference_mode():
        buf = torch.zeros(1)
    t.model.register_buffer("made_in_inference_mode", buf)   # the Tap's cached plan sees the new buffer
    with torch.no_grad(), Tap(t.model) as tap:
        t.forward()
    out["inference_tensor"] = (tap.auditor.path, recs(tap))
    del t.model.made_in_inference_mode
    calls.clear()

    @torch.library.custom_op("tpprobe_test::late_all_reduce", mutates_args=())
    def late(x: torch.Tensor) -> torch.Tensor:       # defined after the first audit: a new door
        return x.clone()

    with torch.no_grad(), Tap(t.model) as tap:
        torch.ops.tpprobe_test.late_all_reduce(torch.ones(2))
    out["late"] = (tap.auditor.path, recs(tap), list(calls))
    w = torch.ones(3, requires_grad=True)
    funcol.all_reduce(w * 2, "sum", dist.group.WORLD).sum().backward()
    out["grad"] = w.grad.tolist()

    def fn(x):                       # compiled under the audit: tracing's fake tensors are not recorded
        return funcol.wait_tensor(funcol.all_reduce(x * 2, "sum", dist.group.WORLD)) + 1

    compiled = torch.compile(fn, backend="eager")
    out["compiled"] = []
    for _ in range(2):
        with torch.no_grad(), Tap(t.model) as tap:
            y = compiled(torch.ones(4))
        out["compiled"].append((recs(tap), y.tolist()))
    has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "ADInplaceOrView")  # noqa: E731
    with torch.no_grad(), Tap(t.model) as tap:
        refused = audit.release()               # an Audit is active: the kernels stay
        t.forward()
    door = lambda: getattr(dist.ProcessGroup.allreduce, "_tpprobe_door", False)  # noqa: E731
    before, released = (has(), door()), audit.release()
    after = (has(), door())
    dist.all_reduce(torch.ones(2))              # no kernel or door of ours on the way, and no error
    with torch.no_grad(), Tap(t.model) as tap:  # the next Audit registers them again
        t.forward()
    out["release"] = (refused, len(recs(tap)), before, released, after, (has(), door()))
    return out


def test_the_audit_runs_only_for_collectives_on_its_own_thread_and_falls_back_to_the_mode():
    res = spawn(_kernel_doors, 2)[0]
    path, kernel, calls = res["kernel"]
    assert path == "kernel" and len(kernel) == 7
    # dist.all_reduce is recorded at ProcessGroup.allreduce's door, once per collective: the
    # dispatcher kernel is not entered at all, nor is the audit's code for any aten op
    assert calls == []
    assert res["entered"] == {"door": 7, "k": 0, "__torch_dispatch__": 0, "counted": 0}   # (counted lives in the test)
    assert kernel[0] == ("embed", None, 2, (5, 64), True, "c10d.allreduce_")
    # with the doors closed the kernel records the same 7, entering audit code once per collective
    assert res["kernel_only"] == ("kernel", kernel, ["c10d::allreduce_"] * 7,
                                  {"door": 0, "k": 7, "__torch_dispatch__": 0})
    assert res["thread"] == ("kernel", kernel, 0)       # the other thread's (3,) reduce is not recorded
    assert res["inference"] == ("mode (inference mode)", kernel)
    assert res["inference_tensor"] == ("mode (the tensors may be inference tensors)", kernel)
    path, late, calls = res["late"]
    assert path == "kernel" and calls == ["tpprobe_test::late_all_reduce"]
    assert late == [("other", None, -1, (2,), False, "tpprobe_test.late_all_reduce")]
    assert res["grad"] == [4.0, 4.0, 4.0]                # backward: all_reduce of 2 * ones over 2 ranks
    one = [("other", None, 2, (4,), True, "_c10d_functional.all_reduce")]
    assert res["compiled"] == [(one, [5.0] * 4)] * 2     # first call compiles: still one record
    # release(): refused while an Audit runs; then no kernel on the op; the next Audit re-registers
    assert res["release"] == (False, 7, (True, True), True, (False, False), (True, True))


def _placed(rank, world):
    """Collectives issued where no hook of the Tap is: inside a plain module of a layer (a patched
    forward), from a user's forward hook on a module, and what each layer runs under."""
    import inspect
    t = _target(rank, world)
    m = t.model
    gate = m.layers[1].mlp.gate_up_proj
    plain = type(gate).forward

    def gate_fwd(x, _g=gate):
        y = plain(_g, x)
        dist.all_reduce(torch.zeros(3))      # inside layers.1.mlp.gate_up_proj's own forward
        return y
    gate.forward = gate_fwd
    m.layers[2].self_attn.register_forward_hook(lambda mod, a, out: dist.all_reduce(torch.zeros(4)))
    m.layers[0].register_forward_hook(lambda mod, a, out: None)      # a layer with a hook of its own
    sig = str(inspect.signature(m.layers[1].forward))
    with torch.no_grad(), Tap(m) as tap:
        during = {i: ("forward" in m.layers[i].__dict__, str(inspect.signature(m.layers[i].forward)) == sig)
                  for i in range(3)}
        t.forward()
    left = sum("forward" in x.__dict__ for x in m.modules() if x is not gate)
    return {"records": [(a.module, a.where, a.source, a.shape) for a in tap.allreduces], "during": during,
            "left": left, "gate_kept": gate.__dict__.get("forward") is gate_fwd,
            "hooks_left": sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules())}


def test_collectives_are_placed_in_the_module_that_runs_them_hooked_or_not():
    for r in spawn(_placed, 2).values():
        recs = r["records"]
        assert ("layers.1.mlp.gate_up_proj", "layer.1", None, (3,)) in recs
        assert ("layers.2.self_attn", "layer.2", None, (4,)) in recs
        assert ("layers.1.mlp.down_proj", "layer.1", "layers.1.mlp.down_proj", (5, 64)) in recs
        assert len(recs) == 9
        # a layer with no hook of its own is wrapped (fast path), one with a hook is hooked;
        # the wrapper keeps the forward's signature
        assert r["during"] == {0: (False, True), 1: (True, True), 2: (True, True)}
        assert r["left"] == 0 and r["gate_kept"]           # the user's own patched forward stays
        assert r["hooks_left"] == 2                         # the test's two hooks only


def _walk_and_row(rank, world):
    """Every collective named twice: as the Tap names it (a leaf row-parallel module of the running
    layer, known from its hooks, ends the search at once) and by the frame walk alone; a hook-issued
    reduce on a row module (after its forward, before the Tap's post hook) and a reduce the row module
    leaves to its caller (reduce_results=False) are among them."""

    class Both(Tap):
        pairs: list = []

        def _attribution(self, tensor):
            row = self._row_now
            fast = super()._attribution(tensor)
            if row is None:           # the walk itself (it marks a matched row output reduced: once)
                Both.pairs.append((fast, fast, False))
                return fast
            self._row_now = None
            try:
                walk = super()._attribution(tensor)
            finally:
                self._row_now = row
            Both.pairs.append((fast, walk, True))
            return fast

    t = _target(rank, world)
    m = t.model
    m.layers[0].mlp.down_proj.register_forward_hook(lambda mod, a, out: dist.all_reduce(torch.zeros(2)))
    m.layers[2].self_attn.o_proj.reduce_results = False       # reduced by the caller, after it returned
    orig = type(m.layers[2].self_attn).forward

    def attn(x, *a, _s=m.layers[2].self_attn, **k):
        out = orig(_s, x, *a, **k)
        dist.all_reduce(out)
        return out
    m.layers[2].self_attn.forward = attn
    with torch.no_grad(), Both(m) as tap:
        t.forward()
    return {"pairs": [(f[:3], w[:3], used) for f, w, used in Both.pairs],
            "records": [(a.module, a.where, a.source) for a in tap.allreduces]}


def test_a_running_leaf_row_module_names_its_collective_as_the_frame_walk_does():
    for r in spawn(_walk_and_row, 2).values():
        assert all(f == w for f, w, _ in r["pairs"]), r["pairs"]
        # named from the hooks: the 2 row modules of layers 0 and 1 (layer 0's down_proj twice: its own
        # reduce and its hook's) and layer 2's down_proj; its o_proj leaves its reduce to the attention
        assert sum(used for _, _, used in r["pairs"]) == 6
        recs = r["records"]
        assert ("layers.0.mlp.down_proj", "layer.0", "layers.0.mlp.down_proj") in recs
        assert ("layers.2.self_attn", "layer.2", "layers.2.self_attn.o_proj") in recs
        assert len(recs) == 1 + 2 * 3 + 1


class _Summaries:
    """A summarize with a ``later`` (as Deferred has): which tensors came through which door."""

    def __init__(self):
        self.now, self.later_ = [], []

    def __call__(self, t):
        self.now.append(t)
        return "now"

    def later(self, t):
        self.later_.append(t)
        return "later"


def _owned(rank, world):
    t = _target(rank, world)
    s = _Summaries()
    keep = ("layer.1.out", "embed.out", "layer.0.in_norm")
    with torch.no_grad(), Tap(t.model, keep=lambda n: n in keep, summarize=s, keep_allreduce_tensors=False) as tap:
        t.forward()
    return {"later": sorted(n for n, v in tap.summaries.items() if v == "later"),
            "now": sorted(n for n, v in tap.summaries.items() if v == "now"),
            "kept": sorted(tap.captures),
            "kept_is_summarized": all(any(x is c for x in s.later_) for c in tap.captures.values()),
            "n": (len(s.now), len(s.later_)), "collectives": len(tap.allreduces)}


def test_the_tensors_the_tap_owns_are_fingerprinted_when_read_and_the_models_at_once():
    """A layer's hidden + residual (a sum the Tap makes) and every whole copy it keeps go to
    ``summarize.later``: a fingerprint made when the forward is read, not between the model's ops; a
    copy is fingerprinted itself, not the model's tensor it came from. Everything else (the model's
    own tensors, the collectives' inputs and outputs) is summarized at once."""
    for r in spawn(_owned, 2).values():
        assert r["later"] == ["embed.out", "layer.0.in_norm", "layer.0.out", "layer.1.out", "layer.2.out"], r
        assert r["kept"] == ["embed.out", "layer.0.in_norm", "layer.1.out"] and r["kept_is_summarized"], r
        # embed.local is the embedding all-reduce's input summary, taken at once with the other
        # collectives' inputs and outputs (7 all-reduces at tp 2)
        assert r["now"] == ["embed.local"] and r["n"] == (2 * 7, 5) and r["collectives"] == 7, r


def _embed_cache(rank, world):
    """The embedding found by one Tap is the only candidate the next Taps of the model watch; a
    Tap that does not find it there (here: the model switched embeddings) sends the next back to
    every candidate."""
    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Embedding(16, 8), torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
            self.use_b = False

        def forward(self, ids):
            h = (self.b if self.use_b else self.a)(ids)
            for layer in self.layers:
                h = layer(h)
            return h

    m = Emb()
    ids = torch.arange(5)
    out = []
    for use_b in (False, False, True, True):
        m.use_b = use_b
        with torch.no_grad(), Tap(m) as tap:
            watched = sorted(h.name for h in tap.handles if h.kind == "embed")
            m(ids)
        out.append((watched, tap.embed_name))
    return out


def test_the_embedding_found_once_is_the_one_watched_next():
    res = spawn(_embed_cache, 1)[0]
    every = ["a", "b"]
    assert res == [(every, "a"), (["a"], "a"), (["a"], None), (every, "b")]


def _waits(rank, world):
    """The audit waits for a c10d op's work through the Python Work it boxes (the op hands the
    kernel a TorchBind ScriptObject; waiting on that crashed NCCL ranks)."""
    from tpprobe.capture import audit
    seen = []
    unbox = dist.Work.unbox

    def counting(obj):
        seen.append(type(obj).__name__)
        return unbox(obj)
    dist.Work.unbox = counting
    out = {}
    try:
        for doors in (True, False):      # ProcessGroup's door hands back the Python Work itself
            audit.sync()
            if not doors:
                audit.set_doors(False)
            x = torch.ones(3)
            with audit.Audit(lambda t: ("m", None, "x", None), keep=lambda w: False) as a:
                dist.all_reduce(x)
            out[doors] = {"seen": list(seen), "records": len(a.records), "path": a.path, "x": x.tolist()}
            seen.clear()
    finally:
        dist.Work.unbox = unbox
        audit.set_doors(True)
    return out


def test_the_audit_waits_through_the_python_work():
    r = spawn(_waits, 2)[0]
    assert r[False] == {"seen": ["ScriptObject"], "records": 1, "path": "kernel", "x": [2.0, 2.0, 2.0]}
    assert r[True] == {"seen": [], "records": 1, "path": "kernel", "x": [2.0, 2.0, 2.0]}


@pytest.mark.gpu
def test_the_audit_on_nccl_collectives_one_gpu():
    """World-1 NCCL on one GPU (the NCCL a one-GPU machine can run): every audited NCCL all-reduce
    completes, is recorded, fingerprinted and placed in its module (the merged tree's audit crashed
    the process on the first one: the 2-GPU NCCL ranks that "wrote nothing")."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "nccl_audit_check.py")], capture_output=True,
                       text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0"})
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)
    assert lines["audit, kernel path"].endswith("path kernel, 1 record(s)")
    assert lines["audit, kernel path, doors closed"].endswith("path kernel, 1 record(s)")
    assert "path mode" in lines["audit, mode path"] and lines["audit, mode path"].endswith("1 record(s)")
    assert lines["audit + fingerprints"].startswith("ok") and "out fp None" not in lines["audit + fingerprints"]
    for k in ("Tap, model all-reducing its row outputs", "Tap + fingerprints, same"):
        assert lines[k].endswith("4 all-reduces, modules ['layers.0.mlp.down_proj', 'layers.0.self_attn.o_proj']")


def _doors_forms(rank, world):
    """Every wrapped ProcessGroup method, and forms the doors leave to the kernel, on real ranks:
    what each records (kind, path, shape, group, op, checked) and through which door."""
    import sys

    from tpprobe.capture import audit
    entered = []
    files = _audit_files()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files and frame.f_code.co_name in ("door", "k"):
            entered.append(frame.f_code.co_name)

    x = torch.full((4, 3), float(rank + 1))
    out = {}
    forms = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_reduce MAX async": lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True).wait(),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8, 3), x[:4].contiguous()),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2, 3), x),
        "pg.allreduce one tensor": lambda: dist.group.WORLD.allreduce(x).wait(),
        "all_gather (list: the kernel)": lambda: dist.all_gather([torch.empty(4, 3) for _ in range(world)], x),
        "all_reduce_coalesced (the kernel)": lambda: dist.all_reduce_coalesced([x, x.clone()]),
        "torch.ops (the kernel)": lambda: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", dist.group.WORLD.group_name)),
    }
    for name, fn in forms.items():
        entered.clear()
        with audit.Audit(lambda t: ("m", None, "x", None), keep=lambda w: False) as a:
            sys.setprofile(prof)
            try:
                fn()
            finally:
                sys.setprofile(None)
        out[name] = ([(r.kind, r.meta()["path"], r.shape, r.group_size, r.meta()["op"], r.checked)
                      for r in a.records], entered.count("door"), entered.count("k"))
    # nested in a wrapper's record (SGLang's GroupCoordinator): folded into it, as the kernel did
    with audit.Audit(lambda t: ("m", None, "x", None), keep=lambda w: False) as a:
        with a.collective("all_reduce", "sglang.GroupCoordinator.all_reduce", x, world):
            dist.all_reduce(x)
    out["nested"] = [(r.kind, r.meta()["path"], r.checked) for r in a.records]
    out["x"] = x[0].tolist()
    return out


def test_the_process_group_doors_record_what_the_kernel_did_and_leave_the_rest_to_it():
    res = spawn(_doors_forms, 2)[0]
    assert res["all_reduce"] == ([("all_reduce", "c10d.allreduce_", (4, 3), 2, "SUM", True)], 1, 0)
    assert res["all_reduce MAX async"] == ([("all_reduce", "c10d.allreduce_", (4, 3), 2, "MAX", True)], 1, 0)
    assert res["all_gather_into_tensor"] == ([("all_gather", "c10d._allgather_base_", (4, 3), 2, "CAT", True)], 1, 0)
    assert res["reduce_scatter_tensor"] == ([("reduce_scatter", "c10d._reduce_scatter_base_", (4, 3), 2, "SUM", True)],
                                            1, 0)
    assert res["pg.allreduce one tensor"] == ([("all_reduce", "c10d.allreduce_", (4, 3), 2, "SUM", True)], 1, 0)
    # the list forms and a direct op call pass the door (or never reach it) and the kernel records them
    assert res["all_gather (list: the kernel)"][1:] == (0, 1)
    assert [r[:2] for r in res["all_gather (list: the kernel)"][0]] == [("all_gather", "c10d.allgather_")]
    assert res["all_reduce_coalesced (the kernel)"][1:] == (0, 1)
    assert [r[1] for r in res["all_reduce_coalesced (the kernel)"][0]] == ["c10d.allreduce_coalesced_"]
    assert res["torch.ops (the kernel)"] == ([("all_reduce", "_c10d_functional.all_reduce", (4, 3), 2, "SUM", True)],
                                             0, 1)
    assert res["nested"] == [("all_reduce", "sglang.GroupCoordinator.all_reduce+c10d.allreduce_", True)]


def test_tpprobe_audit_doors_0_keeps_every_collective_on_the_kernel():
    """The diagnostic switch: with TPPROBE_AUDIT_DOORS=0 an Audit registers its kernels and leaves
    ProcessGroup's methods as they are (and records through the kernel)."""
    import subprocess
    import sys
    code = ("import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "from tpprobe.capture import audit\n"
            "with audit.Audit(lambda t: ('m', None, 'x', None), keep=lambda w: False) as a:\n"
            "    dist.all_reduce(torch.ones(2))\n"
            "print(audit.DOORS.wanted, getattr(dist.ProcessGroup.allreduce, '_tpprobe_door', False),"
            " audit.KERNELS.registered(), len(a.records), a.records[0].path)\n"
            "dist.destroy_process_group()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "TPPROBE_AUDIT_DOORS": "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "False", "True", "1", "c10d.allreduce_"]


def test_each_audit_path_is_an_interceptor_and_the_audit_names_those_that_ran():
    """kernel + doors (the usual), kernel alone (doors closed), the mode (inference mode): each an
    Interceptor entered at start and exited at the end, named by Audit.paths (Audit.path unchanged)."""
    from tpprobe.capture import audit

    def watched(**kw):
        with audit.Audit(lambda t: ("m", None, "x", None), **kw) as a:
            inside = [type(i).__name__ for i in a.interceptors if isinstance(i, audit.Interceptor)]
        return a.path, a.paths, inside, a.interceptors

    assert watched() == ("kernel", ("kernel", "doors"), ["KernelPath", "DoorsPath"], [])
    audit.set_doors(False)
    try:
        assert watched() == ("kernel", ("kernel",), ["KernelPath"], [])
    finally:
        audit.set_doors(True)
    with torch.inference_mode():
        assert watched() == ("mode (inference mode)", ("mode",), ["ModePath"], [])
    assert watched(use_mode=True)[:3] == ("mode (the tensors may be inference tensors)", ("mode",), ["ModePath"])
    assert audit.KERNELS.active == 0 and audit.release() and not audit.KERNELS.registered() and not audit.DOORS.opened


@pytest.mark.gpu
def test_the_c_door_records_every_all_reduce_as_the_python_door_does():
    """allreduce's door in C (fingerprint/triton/native.c `Door`, capture/audit/doors.py) against the
    Python door in the same process, on world-1 NCCL: a checked forward's 9 all-reduces recorded by
    the C door (its count says so), with the same records (module, source, layer, place, shape, dtype,
    group, op, path), the same fingerprints of every input and output and point to the bit, the same
    kept copies, a completion event per all-reduce, nothing left issued; each way twice."""
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "tests.helpers.native_door"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0",
                                                   "TPPROBE_NATIVE": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    runs = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(runs) == 8
    for name, r in runs.items():
        c = name.startswith("c")
        assert r["armed"] and r["fast"] == (9 if c else 0) and r["taker"] == "Taker", (name, r["fast"])
        assert len(r["records"]) == 9 and all(x["timed"] for x in r["records"]), name
        assert r["events"] == list(range(9)) and r["completed"] and r["issued"] is None, name
        kept = "keep=True" in name
        assert all((x["inp"] is not None and x["out"] is not None) == kept for x in r["records"]), name
    for keep in (False, True):
        same = [runs[f"{w}{i} keep={keep}"] for w, i in (("c", 0), ("python", 0), ("c", 1), ("python", 1))]
        first = same[0]
        assert [(x["where"], x["module"]) for x in first["records"]][:3] == [
            ("embed", first["records"][0]["module"]), ("layer.0", "layers.0.self_attn.o_proj"),
            ("layer.0", "layers.0.mlp.down_proj")]
        for r in same[1:]:
            assert r["records"] == first["records"] and r["points"] == first["points"]
