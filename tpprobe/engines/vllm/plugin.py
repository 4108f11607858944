"""vLLM general plugin (`vllm.general_plugins` entry point `tpprobe`): capture a live engine's TP workers.

Declared in pyproject as `tpprobe = "tpprobe.engines.vllm.plugin:register"`. vLLM's
`load_general_plugins()` calls `register()` in every process (API server, engine core, each worker),
possibly more than once: `register()` is idempotent and does nothing unless TPPROBE_CAPTURE_DIR is set.

Settings: the SGLang plugin's (tpprobe/engines/sglang/options.py PluginOptions: TPPROBE_CAPTURE_DIR,
TPPROBE_MAX_STEPS, TPPROBE_FORWARD_MODES, TPPROBE_KEEP, TPPROBE_KEEP_TOKENS, TPPROBE_MAX_BYTES,
TPPROBE_EMBED, TPPROBE_LAYER_LIST), meaning the same here; TPPROBE_SGLANG_MODELS is not read. The
forward modes are named as SGLang names them: `extend` (a forward with a prompt's first token in it:
prefill; a batch that mixes prefill and decode counts as extend) and `decode` (every other forward).
TPPROBE_VLLM_INJECT (tests only; tpprobe/config/knobs.py) breaks the loaded model with one of
tpprobe.engines.vllm.faults' faults, e.g. `skip-allreduce@1`, or `aux-no-residual` (the EAGLE-3
capture hands the draft the layer's output without the residual added). TPPROBE_VLLM_AUX_LAYERS
(tests) turns on an EAGLE-3 style capture with no draft model: vLLM's own `set_aux_hidden_state_layers`
on the model, the packed aux (`torch.cat(aux, -1)`, what the proposer gets) checked slot by slot, and
the runner handed the hidden states only (a runner without a drafter expects no tuple).

Worker side, independent of the model runner: `register()` wraps vLLM's `BaseModelLoader.load_model`,
so whichever runner (V1 or V2) loads the model gets it back with an instance-level `forward` that, for
the first N selected forwards, runs tpprobe's `Tap` (embedding, decoder layers, every all-reduce at
vLLM's `GroupCoordinator` door: tpprobe.engines.vllm.audit) around the model's own forward and writes
the step's folder through the SGLang plugin's own writer (its Budget and write_step, given this
plugin's record and ranks):
DIR/dp{D}-pp{P}/step-{N:06d}/rank-{tp:03d}.{safetensors,json} + manifest.json (TP rank 0 gathers the
entries over the TP group's CPU group; the forward mode is in the manifest and every rank's metadata).

Not covered: forwards replayed from a CUDA graph run no Python (use enforce_eager=True to capture).
An error inside the plugin is printed once (`[tpprobe]` line) and the engine goes on.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

_state = threading.local()
_STEPS = {"n": 0, "captured": 0, "bytes": 0, "announced": False, "failed": False}
_REGISTERED = {"done": False}
_AUX: dict = {"ids": None, "last": None}


def _say(msg: str) -> None:
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def settings():
    from tpprobe.engines.sglang.plugin import settings as sglang_settings
    return sglang_settings()


def register() -> None:
    """Entry point: wrap vLLM's model loader when TPPROBE_CAPTURE_DIR is set; else nothing. Idempotent."""
    s = settings()
    if s is None or _REGISTERED["done"]:
        return
    _REGISTERED["done"] = True
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        if getattr(BaseModelLoader.load_model, "_tpprobe", False):
            return
        orig = BaseModelLoader.load_model

        def load_model(self, *args, **kwargs):
            model = orig(self, *args, **kwargs)
            try:
                attach(model)
            except Exception as e:  # noqa: BLE001 - the engine goes on without the probe
                _say(f"could not attach to the model: {type(e).__name__}: {e}")
            return model

        load_model._tpprobe = True
        BaseModelLoader.load_model = load_model
        _say(f"vLLM plugin registered: capture dir {s['dir']}, first {s['max_steps']} step(s) in modes "
             f"{sorted(s['modes'])}, <= {s['max_bytes']} bytes/rank")
    except Exception as e:  # noqa: BLE001
        _say(f"vLLM plugin FAILED to register: {type(e).__name__}: {e}")


def attach(model: torch.nn.Module) -> None:
    """Give `model` (a loaded vLLM model) the capturing forward, as an instance attribute: every caller
    of `model(...)` (any model runner) goes through it."""
    from tpprobe.config.knobs import knob

    fault = knob("TPPROBE_VLLM_INJECT")
    if fault:
        from tpprobe.engines.vllm.faults import inject

        name, _, arg = fault.partition("@")
        if name == "aux-no-residual":
            aux_no_residual(model)
        else:
            inject(name, model, int(arg) if arg else None)
        _say(f"TEST FAULT injected: {fault}")
    inner = model.forward
    aux_ids = knob("TPPROBE_VLLM_AUX_LAYERS")
    if aux_ids:
        from tpprobe.engines.vllm.tiny import packed_aux, vllm_ids

        _AUX["ids"] = [int(i) for i in aux_ids.split(",") if i.strip()]
        model.set_aux_hidden_state_layers(vllm_ids(_AUX["ids"]))     # vLLM's SupportsEagle3
        raw = inner

        def inner(*args, **kwargs):  # the aux goes to tpprobe, the runner gets what it expects
            out = raw(*args, **kwargs)
            _AUX["last"] = packed_aux(out)
            return out[0] if isinstance(out, tuple) else out
        _say(f"EAGLE-3 style capture on: tpprobe ids {_AUX['ids']} (vLLM ids {vllm_ids(_AUX['ids'])})")

    def forward(*args, **kwargs):
        return _forward(model, inner, args, kwargs)

    model.forward = forward


def aux_no_residual(model) -> None:
    """Test fault: the EAGLE-3 capture appends the layer's output without the residual (h, not h + r)."""
    inner = getattr(model, "model", model)
    orig = inner._maybe_add_hidden_state

    def maybe_add(aux, layer_idx, hidden_states, residual):
        return orig(aux, layer_idx, hidden_states, None)

    inner._maybe_add_hidden_state = maybe_add


def _mode(positions) -> str:
    try:
        return "extend" if positions is not None and bool((positions == 0).any()) else "decode"
    except Exception:  # noqa: BLE001
        return "unknown"


def _forward(model, inner, args, kwargs):
    s = settings()
    if s is None or getattr(_state, "busy", False) or _STEPS["failed"]:
        return inner(*args, **kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    mode = _mode(positions)
    step = _STEPS["n"]
    _STEPS["n"] += 1
    # the same on every rank of the TP group (forward index and mode), never rank-local state
    if (input_ids is None or _STEPS["captured"] >= s["max_steps"]
            or not ("all" in s["modes"] or mode in s["modes"])):
        return inner(*args, **kwargs)
    _STEPS["captured"] += 1
    box: dict = {}

    def run():
        try:
            box["result"] = inner(*args, **kwargs)
        except BaseException as e:  # the model's own error: the engine's, raised as it is
            box["model_error"] = e
            raise
        return box["result"]

    try:
        _capture(s, model, run, input_ids, mode, step)
    except BaseException as e:  # noqa: BLE001 - the plugin's own error: logged once, the engine goes on
        if "model_error" in box:
            raise
        if not _STEPS["failed"]:
            _say(f"capture FAILED at step {step}, the plugin stops capturing (the engine goes on): "
                 f"{type(e).__name__}: {e}")
        _STEPS["failed"] = True
    return box["result"] if "result" in box else inner(*args, **kwargs)


def _capture(s, model, run, input_ids, mode, step) -> None:
    from tpprobe.capture.hooks import Tap
    from tpprobe.capture.record import resolve_summaries
    from tpprobe.engines.sglang.plugin import Budget
    from tpprobe.engines.vllm.audit import vllm_extensions
    from tpprobe.fingerprint.reference import PROBE_K, PROBE_SEED, Deferred
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    rank, world = tp.rank_in_group, tp.world_size
    budget = Budget(s)
    if not _STEPS["announced"]:
        _STEPS["announced"] = True
        _say(f"tp_rank {rank}/{world}: hooking {type(model).__name__} (embedding, decoder layers, "
             f"GroupCoordinator.all_reduce) -> {s['dir']}")
    _state.busy = True
    t0 = time.time()
    fps = Deferred(PROBE_SEED, PROBE_K)
    try:
        with torch.no_grad(), Tap(model, extensions=vllm_extensions(), input_ids=input_ids,
                                  embed=s["embed"], layers=s["layer_list"],
                                  keep=lambda n: budget.match(n), admit=budget.admit,
                                  sample_rows=s["keep_tokens"], keep_allreduce_tensors=False,
                                  summarize=fps) as tap:
            run()
        resolve_summaries(tap, fps, True)
    finally:
        _state.busy = False
    _write_step(s, step, mode, rank, world, tp, tap, input_ids, model, time.time() - t0, budget)
    if _STEPS["captured"] >= s["max_steps"]:
        from tpprobe.capture.audit import release
        release()


def parallel_ranks() -> dict:
    out = {"dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1}
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pp, tp = get_pp_group(), get_tp_group()
        out.update(pp_rank=pp.rank_in_group, pp_size=pp.world_size, tp_rank=tp.rank_in_group, tp_size=tp.world_size)
        from vllm.distributed.parallel_state import get_dp_group

        dp = get_dp_group()
        out.update(dp_rank=dp.rank_in_group, dp_size=dp.world_size)
    except Exception:  # noqa: BLE001 - not published in this process: the defaults
        pass
    return out


def _step_record(s, step, mode, rank, world, tap, input_ids, model, t_forward, budget, par):
    """This rank's record and run settings (tpprobe/engines/step.py, as the SGLang plugin writes them)."""
    from tpprobe.engines.step import step_record, step_settings
    from tpprobe.engines.vllm.tiny import expected_slots

    aux = _AUX["last"] if _AUX["ids"] is not None else None
    if aux is not None and (aux.dim() != 2 or aux.shape[0] != input_ids.shape[0]):
        aux = None
    record = step_record(tap, model=model, rank=rank, world=world, input_ids=input_ids, aux=aux, budget=budget,
                         t_forward=t_forward, extra={
                             "source": "vllm-plugin", "step": step, "forward_mode": mode,
                             "model": type(model).__name__, "parallel": par,
                             "kept_rows": tap.sample_rows, "budget_refused": budget.refused})
    slots = expected_slots(_AUX["ids"]) if aux is not None else ([], [])
    return record, step_settings(record, model, backend="vllm (live engine, plugin)",
                                 tokens=int(input_ids.shape[0]), mode=mode, step=step, par=par, slots=slots)


def _write_step(s, step, mode, rank, world, tp, tap, input_ids, model, t_forward, budget) -> None:
    """The SGLang plugin's step writer (files, the gather over the TP group's CPU group, the manifest)
    with this plugin's record and ranks: `tp` is vLLM's GroupCoordinator (cpu_group, ranks)."""
    from tpprobe.engines.sglang.plugin import write_step

    par = parallel_ranks()

    def record(s, step, mode, rank, world, tap, input_ids, result, model, t_forward, budget):
        return _step_record(s, step, mode, rank, world, tap, input_ids, model, t_forward, budget, par)

    write_step(s, step, mode, rank, world, tp, tap, input_ids, None, model, t_forward, budget,
               record=record, par=par, source="vllm-plugin")
