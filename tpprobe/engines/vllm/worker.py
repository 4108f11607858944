"""vLLM worker extension (`TpprobeWorkerExtension`): the plugin's rank-side capture and its collective_rpc calls.

vLLM mixes the class named by `--worker-extension-cls` (ParallelConfig.worker_extension_cls) into every
worker's class (v1/worker/worker_base.py WorkerWrapperBase.init_worker); its methods are called on
every worker with `LLM.collective_rpc(name, args=...)` (the engine's `collective_rpc`), one answer per
worker. tpprobe's general plugin (tpprobe.engines.vllm.plugin) names this class when
TPPROBE_CAPTURE_DIR is set and the user named no extension of their own, and calls `tpprobe_attach`
once the engine has loaded and warmed up the model. Every name is prefixed `tpprobe_` (vLLM asserts
that an extension adds no name the worker class has):

  tpprobe_attach()       give `self.model_runner.model` the capturing forward (idempotent); its status
  tpprobe_status()       this worker's tp rank and size, forwards seen, steps captured, bytes written,
                         the capture folder, whether capture failed (stopped) and whether it is attached
  tpprobe_capture(n, modes="all")   capture the next n forwards in `modes` (e.g. a decode long after
                         start); its status (with `error`, one line, and no window for an unknown mode)

The capture itself (module-level: one model per worker process) is whichever runner calls the model:
`attach(model)` sets an instance-level `forward` that, for the selected forwards, runs tpprobe's `Tap`
(embedding, decoder layers, every all-reduce at vLLM's `GroupCoordinator` door:
tpprobe.engines.vllm.audit) around the model's own forward and writes the step's folder through the
SGLang plugin's own writer (its Budget and write_step, given this plugin's record and ranks):
DIR/dp{D}-pp{P}/step-{N:06d}-{mode}/rank-{tp:03d}.{safetensors,json} + manifest.json, N the forward
index since attach, mode `extend` or `decode` (the entries are all-gathered over the TP group's CPU
group, TP rank 0 writes the manifest; the forward mode is also in the manifest and every rank's
metadata). The plugin's loader wrap (a user's own extension) calls the same `attach`.

An error inside the capture is printed once (one `[tpprobe]` line, by TP rank 0 when it happens in a
captured step: the step's exchange tells every rank, and all stop capturing together) and the engine
goes on; an error of the model's own is raised as it is. Test faults (TPPROBE_VLLM_INJECT,
TPPROBE_VLLM_AUX_LAYERS: tpprobe/config/knobs.py) are made in `attach`.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

# process-wide by nature: one vLLM worker process serves one TP rank for its whole life; this is its
# capture's state (reported by tpprobe_status, reset by tpprobe_capture)
_state = threading.local()
# n: forwards seen since attach; limit/modes: a tpprobe_capture window (None: the settings')
_STEPS = {"n": 0, "captured": 0, "bytes": 0, "announced": False, "failed": False, "attached": False,
          "limit": None, "modes": None}
_AUX: dict = {"ids": None, "last": None}
_PLUGIN_ERROR: dict = {"rank": None}     # TPPROBE_VLLM_INJECT=plugin-error@R (tests)


def say(msg: str) -> None:
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


# vLLM has no forward mode: the plugin names a forward by its positions (`_mode`)
MODES = {"extend": "a forward with a prompt's first token in it, vLLM's prefill", "decode": "every other forward"}


def settings():
    """The plugin's settings (the SGLang plugin's, tpprobe/engines/sglang/options.py, with vLLM's modes); None
    when TPPROBE_CAPTURE_DIR is unset or a setting cannot be read (said in one line: the plugin stays off)."""
    from tpprobe.engines.sglang.options import plugin_settings
    return plugin_settings("vLLM", modes=MODES, say=say)


class TpprobeWorkerExtension:
    """Mixed into vLLM's worker class (`--worker-extension-cls
    tpprobe.engines.vllm.worker.TpprobeWorkerExtension`); call through `collective_rpc`."""

    def tpprobe_attach(self) -> dict:
        """Attach the capture to this worker's loaded model (`self.model_runner` model); idempotent."""
        if settings() is not None and not _STEPS["attached"]:
            try:
                attach(self.get_model())     # the runner's model, out of any CUDA-graph wrapper
            except Exception as e:  # noqa: BLE001 - the engine goes on without the probe
                say(f"could not attach to the model: {type(e).__name__}: {e}")
        return status()

    def tpprobe_status(self) -> dict:
        """This worker's capture: tp rank and size, forwards seen, steps captured, bytes, folder, failed."""
        return status()

    def tpprobe_capture(self, n: int, modes: str = "all") -> dict:
        """Capture the next `n` forwards in `modes` (comma list of `extend`, `decode`, or `all`)."""
        return capture_next(n, modes)

    def tpprobe_watch(self, n: int) -> dict:
        """Check one forward in `n` from now on (0: off): tpprobe.engines.watch."""
        from tpprobe.engines import watch
        return {**status(), "watch": watch.set_every(n)}


def status() -> dict:
    s = settings()
    par = parallel_ranks()
    return {"tp_rank": par.get("tp_rank"), "tp_size": par.get("tp_size"), "pid": os.getpid(),
            "attached": _STEPS["attached"], "forwards": _STEPS["n"], "captured": _STEPS["captured"],
            "limit": _limit(s) if s else 0, "bytes": _STEPS["bytes"], "dir": str(s["dir"]) if s else None,
            "failed": _STEPS["failed"], "watch": _watch_status()}


def _watch_status() -> dict:
    from tpprobe.engines import watch
    watch.flush(force=True)
    return watch.status()


def capture_next(n: int, modes: str = "all") -> dict:
    """Open a window: the next `n` forwards in `modes` are captured (the same call reaches every
    worker between the same two forwards: collective_rpc is ordered with the engine's steps). An `n` or a
    mode it cannot read opens no window: its status carries `error`, one line TP rank 0 also logs (an
    exception here would be a traceback in every worker's log, through vLLM's RPC)."""
    from tpprobe.engines.sglang.options import unknown_modes

    picked = {m.strip().lower() for m in str(modes).split(",") if m.strip()} or {"all"}
    try:
        count = int(n)
    except (TypeError, ValueError):
        count = -1
    why = "" if count >= 0 else f"n={n!r} is not a whole number >= 0 (the forwards to capture)"
    why = why or unknown_modes(picked, MODES)
    if why:
        line = f"tpprobe_capture({n!r}, {modes!r}): {why}; no capture window opened"
        if parallel_ranks().get("tp_rank", 0) == 0:
            say(line)
        return {**status(), "error": line}
    n = count
    _STEPS["limit"] = _STEPS["captured"] + max(0, int(n))
    _STEPS["modes"] = picked
    say(f"capturing the next {int(n)} forward(s) in modes {sorted(picked)}"
        + (" (NOT: capture failed earlier and stays off)" if _STEPS["failed"] else ""))
    return status()


def _limit(s) -> int:
    return s["max_steps"] if _STEPS["limit"] is None else _STEPS["limit"]


def _wanted(s, mode) -> bool:
    modes = s["modes"] if _STEPS["modes"] is None else _STEPS["modes"]
    return _STEPS["captured"] < _limit(s) and ("all" in modes or mode in modes)


def _watched(s, step: int) -> bool:
    from tpprobe.engines import watch
    watch.configure(s.get("watch"))
    return watch.watched(step)


def attach(model: torch.nn.Module) -> None:
    """Give `model` (a loaded vLLM model) the capturing forward, as an instance attribute: every caller
    of `model(...)` (any model runner) goes through it. Once per process (a second call: nothing)."""
    if _STEPS["attached"]:
        return
    from tpprobe.config.knobs import knob

    fault = knob("TPPROBE_VLLM_INJECT")
    if fault:
        from tpprobe.engines.vllm.faults import inject

        name, _, arg = fault.partition("@")
        if name == "aux-no-residual":
            aux_no_residual(model)
        elif name == "plugin-error":      # not the model's: a fault in the plugin's own code, on TP rank R
            _PLUGIN_ERROR["rank"] = int(arg) if arg else 0
        else:
            inject(name, model, int(arg) if arg.isdigit() else (arg or None))
        say(f"TEST FAULT injected: {fault}")
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
        say(f"EAGLE-3 style capture on: tpprobe ids {_AUX['ids']} (vLLM ids {vllm_ids(_AUX['ids'])})")

    def forward(*args, **kwargs):
        return _forward(model, inner, args, kwargs)

    model.forward = forward
    _STEPS["attached"] = True
    from tpprobe.engines.vllm.drafter import install

    # what an EAGLE-3 drafter receives, and vLLM's acceptance (inert without a drafter)
    install(model, say, parallel_ranks, lambda: _STEPS["n"], lambda: _STEPS["bytes"], settings)


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
    if s is None or getattr(_state, "busy", False):
        return inner(*args, **kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    mode = _mode(positions)
    step = _STEPS["n"]
    _STEPS["n"] += 1
    # the same on every rank of the TP group (forward index and mode), never rank-local state
    if input_ids is None and kwargs.get("inputs_embeds") is not None and not _STEPS.get("embeds_said"):
        _STEPS["embeds_said"] = True      # a multimodal model (Kimi-K2.5): the runner embeds outside the model
        if parallel_ranks().get("tp_rank", 0) == 0:     # one line for the TP group, not one per rank
            say(f"{type(model).__name__}: forwards with inputs_embeds and no input_ids are not captured (vLLM "
                f"embeds the prompt outside a multimodal model's forward): serve with --language-model-only to "
                f"capture the text model")
    if input_ids is None or _STEPS["failed"] or not _wanted(s, mode):
        if input_ids is not None and _watched(s, step):      # TPPROBE_WATCH: tpprobe/engines/watch.py
            from tpprobe.engines.vllm.watch import watch_forward
            return watch_forward(s, model, lambda: inner(*args, **kwargs), input_ids, mode, step, parallel_ranks)
        return inner(*args, **kwargs)
    _STEPS["captured"] += 1
    from tpprobe.engines.vllm.drafter import arm

    arm(step, mode)         # the proposer after this forward compares its input with this forward's streams
    box: dict = {}

    def run():
        try:
            box["result"] = inner(*args, **kwargs)
        except BaseException as e:  # the model's own error: the engine's, raised as it is
            box["model_error"] = e
            raise
        return box["result"]

    try:
        _capture(s, model, run, input_ids, mode, step, box)
    except BaseException as e:  # noqa: BLE001 - the plugin's own error: logged once, the engine goes on
        if "model_error" in box:
            raise
        if not _STEPS["failed"]:
            say(f"capture FAILED at step {step}, the plugin stops capturing (the engine goes on): "
                f"{type(e).__name__}: {e}")
        _STEPS["failed"] = True
        from tpprobe.engines.vllm.drafter import stop
        stop()
    return box["result"] if "result" in box else inner(*args, **kwargs)


def _capture(s, model, run, input_ids, mode, step, box) -> None:
    """One captured forward on this rank. An error of the plugin's in the Tap (this rank's alone,
    maybe) is carried into the step's exchange, which every rank joins after its forward: the whole
    TP group learns it there and stops capturing together (no rank left waiting in a collective);
    TP rank 0 logs it once."""
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
        say(f"tp_rank {rank}/{world}: hooking {type(model).__name__} (embedding, decoder layers, "
             f"GroupCoordinator.all_reduce) -> {s['dir']}")
    _state.busy = True
    t0 = time.time()
    fps = Deferred(PROBE_SEED, PROBE_K)
    tap, error = None, None
    try:
        with torch.no_grad(), Tap(model, extensions=vllm_extensions(), input_ids=input_ids,
                                  embed=s["embed"], layers=s["layer_list"],
                                  keep=lambda n: budget.match(n), admit=budget.admit,
                                  sample_rows=s["keep_tokens"], keep_allreduce_tensors=False,
                                  summarize=fps) as tap:
            run()
        resolve_summaries(tap, fps, True)
        if _PLUGIN_ERROR["rank"] == rank:
            raise RuntimeError(f"TPPROBE_VLLM_INJECT=plugin-error@{rank}: a fault in the plugin's own code")
    except Exception as e:  # noqa: BLE001
        if "model_error" in box:
            raise
        error = f"{type(e).__name__}: {e}"
    finally:
        _state.busy = False
    if "result" not in box:     # the Tap failed before the model ran: the forward (its collectives) first
        run()
    t_forward = time.time() - t0
    if _write_step(s, step, mode, rank, world, tp, tap, input_ids, model, t_forward, budget, error=error):
        _STEPS["failed"] = True     # every rank of the TP group saw the same errors: they stop together
        from tpprobe.engines.vllm.drafter import stop
        stop()                      # the drafter's capture too: the one line said the plugin stops
    if _STEPS["captured"] >= _limit(s) or _STEPS["failed"]:
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
    from tpprobe.engines.capture_rule import vllm_knob_slots

    aux = _AUX["last"] if _AUX["ids"] is not None else None
    if aux is not None and (aux.dim() != 2 or aux.shape[0] != input_ids.shape[0]):
        aux = None
    record = step_record(tap, model=model, rank=rank, world=world, input_ids=input_ids, aux=aux, budget=budget,
                         t_forward=t_forward, extra={
                             "source": "vllm-plugin", "step": step, "forward_mode": mode,
                             "model": type(model).__name__, "parallel": par,
                             "kept_rows": tap.sample_rows, "budget_refused": budget.refused})
    slots = vllm_knob_slots(_AUX["ids"])[0] if aux is not None else ([], [])    # TPPROBE_ID_RULE: a patched build
    extra = {}
    engine_ids = sorted({int(i) for i in getattr(getattr(model, "model", model), "aux_hidden_state_layers", ())
                         or ()})
    if aux is None and engine_ids:
        # no aux of tpprobe's own: the ids vLLM itself captures for its EAGLE-3 drafter (the step's title names them)
        extra["aux ids"] = f"{engine_ids} (vLLM's, for its EAGLE-3 drafter)"
    return record, step_settings(record, model, backend="vllm (live engine, plugin)",
                                 tokens=int(input_ids.shape[0]), mode=mode, step=step, par=par, slots=slots,
                                 extra=extra)


def _write_step(s, step, mode, rank, world, tp, tap, input_ids, model, t_forward, budget, error=None) -> list:
    """The SGLang plugin's step writer (files, the all-gather over the TP group's CPU group, the
    manifest) with this plugin's record and ranks: `tp` is vLLM's GroupCoordinator (cpu_group, ranks).
    Returns every rank's error of this step (the same on every rank)."""
    from tpprobe.engines.sglang.plugin import step_dir, write_step

    par = parallel_ranks()

    def record(s, step, mode, rank, world, tap, input_ids, result, model, t_forward, budget):
        return _step_record(s, step, mode, rank, world, tap, input_ids, model, t_forward, budget, par)

    errors = write_step(s, step, mode, rank, world, tp, tap, input_ids, None, model, t_forward, budget,
                        record=record, par=par, source="vllm-plugin", error=error)
    if not errors:
        _STEPS["bytes"] += _written(step_dir(s["dir"], par, step, mode), rank)
    return errors


def _written(out, rank: int) -> int:
    """Bytes of this rank's files of one step on disk (its metadata and kept tensors)."""
    try:
        return sum(f.stat().st_size for f in out.glob(f"rank-{rank:03d}.*"))
    except OSError:
        return 0
