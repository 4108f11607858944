"""SGLang general plugin (`sglang.srt.plugins` entry point `tpprobe`): capture live TP ranks.

Declared in pyproject as `tpprobe = "tpprobe.engines.sglang.plugin:register"`. SGLang's `load_plugins()`
calls `register()` in every process that loads plugins (engine, each scheduler = TP/PP rank
worker, DP controller, detokenizer). Nothing happens unless TPPROBE_CAPTURE_DIR is set.

Settings (environment; declared once in tpprobe/engines/sglang/options.py PluginOptions, which reads them):
  TPPROBE_CAPTURE_DIR    folder to write to (required to enable anything)
  TPPROBE_MAX_STEPS      forwards to capture per rank (default 1), counted over the selected modes
  TPPROBE_FORWARD_MODES  comma list of ForwardMode names to capture (default "extend"; "all")
  TPPROBE_KEEP           comma list of point-name patterns kept as FULL tensors (default: none,
                         every point is a fingerprint of a few KB; "*" keeps every point; names:
                         embed.local, embed.out, layer.K.out, layer.0.in_norm, aux.packed,
                         input_ids; all-reduce inputs / outputs are fingerprinted only)
  TPPROBE_KEEP_TOKENS    keep at most this many token rows of each kept tensor (default: all)
  TPPROBE_MAX_BYTES      byte budget for kept tensors per rank over the run (default 2e9), checked
                         BEFORE each copy: a tensor that does not fit is fingerprinted, not copied
  TPPROBE_EMBED          the embedding's module path or class glob (default: found from structure,
                         the module that takes the input ids and returns [tokens, hidden])
  TPPROBE_LAYER_LIST     the decoder layers' ModuleList path or class glob (default: the longest list)
  TPPROBE_SGLANG_MODELS  comma list of dotted `Class.forward` targets to wrap (default: SGLang's
                         LlamaForCausalLM, DeepseekV2ForCausalLM (DeepseekV3 inherits it) and
                         KimiK25ForConditionalGeneration, whose DeepseekV3 `language_model` runs inside
                         its forward: a wrapped model inside another is captured once, as the outer one)
  TPPROBE_DRAFT_TRAINED  what the EAGLE-3 draft was trained on, `ids:A,B,C` (HF hidden_states) or
                         `convention:output|before|vllm` (tpprobe/engines/draft_training.py): the aux
                         slots are checked against it

The EAGLE-3 draft (`LlamaForCausalLMEagle3` inherits the wrapped forward) is not captured as a model: what
it receives, `forward_batch.spec_info.hidden_states`, is written as step-{N:06d}-draft_input beside the
target forward N that produced it (tpprobe/engines/sglang/draft_input.py). SGLang's own accept counts go
to DIR/dp{D}-pp{P}/acceptance.json (tpprobe/engines/sglang/acceptance.py).

Layout: DIR/dp{D}-pp{P}/step-{N:06d}-{mode}/rank-{tp:03d}.{safetensors,json} + manifest.json per TP
group, N the forward index of this process (every forward counts, captured or not, so steps line up
across ranks), mode its forward mode (extend = a prefill, decode, target_verify, ...: `step_name`),
D / P SGLang's data-parallel and pipeline ranks; each file's metadata carries `parallel` = {dp, pp,
attn_tp, attn_dp, tp} ranks and sizes and the `forward_mode`, and so does the manifest. Folders
written before the mode was in the name (`step-{N:06d}`) are read too. `tpprobe report DIR` over
such a folder checks every step and names the first step and point where the ranks diverge.
Whether a step is captured depends on the forward index and mode only (the same on every rank of
a TP group), never on rank-local state, so the one collective per captured step (the manifest's
all-gather over the TP group's CPU group) is joined by every rank.

Per captured forward, inside the model's own forward, each TP rank runs tpprobe's `Tap`
(embedding, decoder layers, every torch.distributed.all_reduce) with the SGLang extensions of
`tpprobe.engines.sglang.stream`, fingerprints every point as it passes (nothing is cloned unless kept), and
writes `rank-NNN.json` (the fingerprints, with the metadata keys `tpprobe probe --exchange
fingerprint` writes: `embed.local`, `embed.out`, `layer.K.out` = the residual stream leaving layer K
= HF hidden_states[K+1], `aux.packed`, each all-reduce's `in_fp` / `out_fp`) and
`rank-NNN.safetensors` (the kept tensors only) with `write_rank`. TP rank 0 gathers the file
entries over the TP group's CPU (gloo) group and writes `manifest.json` whose `settings` carry
world_size, dtype, hidden, num_layers and the slot expectations derived from the live model's
`layers_to_capture` (layer_ids / expected_points / expected_ids), so `tpprobe report` runs the
same cross-rank checks offline.

Not covered: forwards SGLang replays from a CUDA graph run no Python, so the plugin neither captures
nor counts them (the graph taps, `tpprobe.capture.graph_tap`, are not wired into CudaGraphRunner).

SGLang 0.5.23 decoder layers return an opaque `OwedOutput` (the MLP's partial sum, reduced at the
next layer's input), so a forward hook on a layer cannot see the residual stream: the extension
hands each layer's `attn_boundary.prepare` a `capture` callback (SGLang's own EAGLE-3 capture
mechanism; it completes the owed reduce at that boundary, as EAGLE-3 capture does; values are
unchanged, the fused all-reduce+norm kernel is not used for that boundary) and reads the last
layer's stream from the final norm.

SGLang logs and swallows plugin exceptions, so this plugin prints its own state loudly: one
`[tpprobe]` line per rank when it hooks, and one per written step. A setting that does not read
(TPPROBE_MAX_STEPS=abc, ...) is one line, and the plugin stays off (options.plugin_settings).
A step that fails to be written on any rank (an unwritable TPPROBE_CAPTURE_DIR, an error in the
record) is logged ONCE, by TP rank 0, naming the ranks, and every rank of the group stops capturing
(they learn it from the step's one exchange, an all-gather over the TP group's CPU group); the
engine goes on.

GPU path: this module never imports tpprobe.engines.sglang.cpu_mode.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

# process-wide by nature: the plugin's per-process state in an SGLang worker (one server, one step count)
_state = threading.local()
_STEPS = {"n": 0, "captured": 0, "bytes": 0, "announced": False, "failed": False}


def _say(msg: str) -> None:
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def settings() -> Optional[dict]:
    """The plugin's settings from the environment (declared in tpprobe/engines/sglang/options.py
    PluginOptions); None unless TPPROBE_CAPTURE_DIR is set, and None (the plugin off, said in one line) when
    a setting cannot be read."""
    from tpprobe.engines.sglang.options import plugin_settings
    return plugin_settings("SGLang", say=_say)


def register() -> None:
    """Entry point: register the AROUND hooks when TPPROBE_CAPTURE_DIR is set and every setting reads; else
    nothing (a setting that does not read is one line: `settings`)."""
    s = settings()
    if s is None:
        return
    try:
        from tpprobe.engines.sglang import version_line
        _say(version_line())
    except Exception as e:  # noqa: BLE001 - a line of news never stops the server
        _say(f"could not read SGLang's version: {type(e).__name__}: {e}")
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target in s["targets"]:
            HookRegistry.register(target, _around_forward, HookType.AROUND)
        from tpprobe.engines.sglang import acceptance
        acceptance.register(s, _say, parallel_ranks, lambda: _STEPS["n"])   # SGLang's accept counts
        from tpprobe.engines.sglang.watch import RPC_TARGET, handle_rpc    # tpprobe_watch / tpprobe_status
        HookRegistry.register(RPC_TARGET, handle_rpc, HookType.AROUND)
        _say(f"plugin registered: will wrap {', '.join(s['targets'])} and read {acceptance.TARGET}; "
             f"capture dir {s['dir']}, "
             f"first {s['max_steps']} step(s) in modes {sorted(s['modes'])}, <= {s['max_bytes']} bytes/rank")
    except Exception as e:  # noqa: BLE001 - SGLang would swallow it silently
        _say(f"plugin FAILED to register: {type(e).__name__}: {e}")
        raise


def _mode_name(forward_batch) -> str:
    m = getattr(forward_batch, "forward_mode", None)
    return getattr(m, "name", str(m)).lower()


def _tp():
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return p.tp_rank, p.tp_size, p.tp_group



def _watched(s, step: int) -> bool:
    from tpprobe.engines import watch
    watch.configure(s.get("watch"))
    return watch.watched(step)


def parallel_ranks() -> dict:
    """This process's ranks and sizes as SGLang defines them (dp None = no DP controller: 0)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    out = {}
    for name in ("dp", "pp", "attn_tp", "attn_dp", "tp"):
        for suffix, default in (("rank", 0), ("size", 1)):
            try:
                v = getattr(p, f"{name}_{suffix}")
            except Exception:  # noqa: BLE001 - not published in this process: the default
                v = None
            out[f"{name}_{suffix}"] = int(v) if isinstance(v, int) and not isinstance(v, bool) else default
    return out


class Budget:
    """Bytes of full tensors this rank may still copy; asked BEFORE each copy."""

    def __init__(self, s: dict):
        import fnmatch

        self.patterns, self.rows = s["keep"], s["keep_tokens"]
        self.max_bytes = s["max_bytes"]
        self.match = lambda n: any(fnmatch.fnmatchcase(n, p) for p in self.patterns)
        self.refused: list[str] = []

    def admit(self, name: str, t: torch.Tensor) -> bool:
        if not self.match(name):
            return False
        rows = t.shape[0] if (self.rows is None or t.dim() == 0) else min(self.rows, t.shape[0])
        nbytes = (t.numel() // max(t.shape[0], 1) if t.dim() else 1) * rows * t.element_size()
        if _STEPS["bytes"] + nbytes > self.max_bytes:
            self.refused.append(name)
            return False
        _STEPS["bytes"] += nbytes
        return True


# the speculative drafts' model files: their classes inherit a wrapped forward (LlamaForCausalLMEagle3 is a
# LlamaForCausalLM) but a draft is not the TP target the plugin probes: an EAGLE-3 draft's input is captured
# (draft_input), every other draft's forwards pass through uncounted
DRAFT_MODULES = ("_eagle", "_eagle3", "_nextn", "_mtp")


def _around_forward(original_fn, self, input_ids, positions, forward_batch, *args, **kwargs):
    from tpprobe.engines.sglang import draft_input
    if getattr(_state, "inside", False) or (type(self).__module__.endswith(DRAFT_MODULES)
                                            and not draft_input.is_eagle3_draft(self)):
        # a wrapped model inside another (Kimi-K2.5's language model), or an MTP / EAGLE (not 3) draft
        return original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    _state.inside = True
    try:
        return _capture_forward(original_fn, self, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        _state.inside = False


def _capture_forward(original_fn, self, input_ids, positions, forward_batch, *args, **kwargs):
    s = settings()
    if s is None or getattr(_state, "busy", False):
        return original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    from tpprobe.engines.sglang import draft_input
    if draft_input.is_eagle3_draft(self):     # LlamaForCausalLMEagle3 inherits the wrapped forward
        host = draft_input.Host(tp=_tp, parallel_ranks=parallel_ranks, budget=Budget, write_step=write_step,
                                mode_name=_mode_name, steps=_STEPS, say=_say)
        return draft_input.around_draft(original_fn, s, host, self, input_ids, positions, forward_batch, *args,
                                        **kwargs)
    mode = _mode_name(forward_batch)
    step = _STEPS["n"]
    _STEPS["n"] += 1
    # the same on every rank of the TP group (forward index and mode), never rank-local state
    if _STEPS["failed"] or _STEPS["captured"] >= s["max_steps"] or not ("all" in s["modes"] or mode in s["modes"]):
        if _watched(s, step):       # TPPROBE_WATCH: tpprobe/engines/watch.py
            from tpprobe.engines.sglang.watch import watch_forward
            return watch_forward(s, self, lambda: original_fn(self, input_ids, positions, forward_batch, *args,
                                                              **kwargs), input_ids, mode, step, _tp, parallel_ranks)
        return original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    _STEPS["captured"] += 1
    from tpprobe.capture.hooks import Tap
    from tpprobe.capture.record import resolve_summaries
    from tpprobe.fingerprint.reference import PROBE_K, PROBE_SEED, Deferred
    from tpprobe.engines.sglang.stream import decoder_layers, sglang_extensions, text_model

    rank, world, tp_group = _tp()
    budget = Budget(s)
    if "extend" in mode and _sample_pending():      # a SpecForge sample is matched to a prefill's streams
        budget.patterns = [*budget.patterns, *draft_input.SAMPLE_STREAMS]
    text, where = text_model(self)
    layers = decoder_layers(text)
    if not _STEPS["announced"]:
        _STEPS["announced"] = True
        _say(f"tp_rank {rank}/{world}: hooking {type(self).__name__} (VocabParallelEmbedding, "
             f"{len(layers)} decoder layers, torch.distributed.all_reduce, the residual stream at "
             f"every layer boundary and the final norm) -> {s['dir']}")
    _state.busy = True
    t0 = time.time()
    # every point's and every all-reduce's fingerprint is queued on the stream as it passes (on a
    # GPU: no host sync inside the forward) and read after it with one device-to-host copy
    fps = Deferred(PROBE_SEED, PROBE_K)
    try:
        with torch.no_grad(), Tap(self, extensions=sglang_extensions(), input_ids=input_ids,
                                  embed=s["embed"] or (f"{where}model.embed_tokens" if where else None),
                                  layers=s["layer_list"] or (f"{where}model.layers" if where else None),
                                  keep=lambda n: budget.match(n), admit=budget.admit,
                                  sample_rows=s["keep_tokens"], keep_allreduce_tensors=False,
                                  summarize=fps) as tap:
            tap.stream_from_layer_output = False    # 0.5.23 layers return an owed output
            result = original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
        resolve_summaries(tap, fps, True)
    finally:
        _state.busy = False
    t_forward = time.time() - t0
    if write_step(s, step, mode, rank, world, tp_group, tap, input_ids, result, self, t_forward, budget):
        _STEPS["failed"] = True     # every rank of the TP group saw the same errors: they stop together
    else:       # the draft's forward that follows reads this forward's aux: checked against these streams
        draft_input.remember_target(tap=tap, step=step, mode=mode, input_ids=input_ids, model=self,
                                    aux=_aux(result, int(input_ids.shape[0]))[0])
    if _STEPS["captured"] >= s["max_steps"]:
        # the last captured step: the audit's kernels come off, so the server's later forwards run
        # their collectives with no Python of tpprobe's (capture/audit/recorder.py: release)
        from tpprobe.capture.audit import release
        release()
    return result


def _sample_pending() -> bool:
    from tpprobe.engines.draft_training import from_env
    from tpprobe.engines.sglang import draft_input
    try:
        return draft_input.sample_pending(from_env())
    except Exception:  # noqa: BLE001 - a bad setting is said at the draft's step
        return False


def _aux(result, tokens: int):
    """The packed aux tensor the draft receives, when it has one row per input token."""
    aux = getattr(result, "hidden_states", None)
    if aux is not None and not isinstance(aux, torch.Tensor):
        try:
            from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

            aux = pack_aux_hidden_states(aux)
        except Exception:  # noqa: BLE001
            return None, "aux hidden states could not be packed"
    if not isinstance(aux, torch.Tensor):
        return None, "no aux hidden states in this forward's output"
    if aux.dim() != 2 or aux.shape[0] != tokens:
        return None, (f"aux hidden states have {aux.shape[0]} rows for {tokens} tokens "
                      f"(CaptureHiddenMode LAST?): slots not checked")
    return aux, None


def _step_record(s, step, mode, rank, world, tap, input_ids, result, model, t_forward, budget):
    """This rank's record (the one rank record `tpprobe probe` writes too, with every point's fingerprint
    and each all-reduce's in_fp / out_fp, its kept tensors under the byte budget) and run settings."""
    from tpprobe.engines.capture_rule import sglang_live_slots
    from tpprobe.engines.step import step_record, step_settings

    tokens = int(input_ids.shape[0])
    aux, aux_note = _aux(result, tokens)
    from tpprobe.engines.sglang.stream import text_model
    ltc = list(getattr(getattr(text_model(model)[0], "model", None), "layers_to_capture", []) or [])
    par = parallel_ranks()
    record = step_record(tap, model=model, rank=rank, world=world, input_ids=input_ids, aux=aux, budget=budget,
                         t_forward=t_forward, extra={
                             # plugin-only facts
                             "source": "sglang-plugin", "step": step, "forward_mode": mode,
                             "model": type(model).__name__, "parallel": par, "layers_to_capture": ltc,
                             "aux_note": aux_note, "kept_rows": tap.sample_rows, "budget_refused": budget.refused})
    # the rule every reader goes through (tpprobe.engines.capture_rule); TPPROBE_ID_RULE describes a patched build
    slots, rule_note = sglang_live_slots(type(model).__name__, ltc, len(tap.layer_indices)) if aux is not None \
        else (([], []), "")
    from tpprobe.engines.sglang.draft_input import refused, target_expectation
    slots, basis = target_expectation(slots, aux is not None)
    refused(basis, rank, _say)
    return record, step_settings(record, model, backend="sglang (live server, plugin)", tokens=tokens, mode=mode,
                                 step=step, par=par, slots=slots, extra={"sglang layers_to_capture": str(ltc), **basis,
                                                                         **({"id rule": rule_note} if rule_note
                                                                            else {})})


def step_name(step: int, mode: str) -> str:
    """`step-{N:06d}-{mode}`: the forward index and its forward mode (extend, decode, target_verify, ...;
    lower case, anything but [a-z0-9_] made `_`). Readers also take the old `step-{N:06d}`."""
    safe = re.sub(r"[^a-z0-9_]+", "_", str(mode).lower()).strip("_") or "unknown"
    return f"step-{step:06d}-{safe}"


def step_dir(root: Path, par: dict, step: int, mode: str) -> Path:
    """DIR/dp{D}-pp{P}/step-{N:06d}-{mode}: one folder per TP group and forward."""
    return root / f"dp{par['dp_rank']}-pp{par['pp_rank']}" / step_name(step, mode)


def write_step(s, step, mode, rank, world, tp_group, tap, input_ids, result, model, t_forward, budget, *,
                record=None, par=None, source="sglang-plugin", error: Optional[str] = None) -> list:
    """Write this rank's files; TP rank 0 writes the manifest. Every rank ALWAYS joins the exchange
    (also when its own capture or write failed: `error`, then nothing of its own is written), so one
    rank's error never hangs the others. Returns every rank's error of this step as (rank, text),
    the same list on every rank of the TP group (an all-gather), so the callers stop capturing
    together; TP rank 0 logs them in ONE line. `record` returns the step's (RankRecord, run settings)
    (engines/step.py); `record`, `par` and `source`: another engine's plugin (tpprobe.engines.vllm.plugin)
    writing through this one."""
    from tpprobe import __version__
    from tpprobe.formats.capture_dir import write_manifest, write_rank

    record = _step_record if record is None else record
    out = step_dir(s["dir"], parallel_ranks() if par is None else par, step, mode)
    entries: list = []
    run_settings: dict = {}
    nbytes = 0
    if error is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            rec, run_settings = record(s, step, mode, rank, world, tap, input_ids, result, model, t_forward,
                                       budget)
            nbytes = rec.kept_bytes
            entries = write_rank(out, rank, rec.tensors, rec.to_json())
        except Exception as e:  # noqa: BLE001 - the engine would swallow it; still join the exchange below
            error = f"{type(e).__name__}: {e}"
    mine = (entries, run_settings, error)
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, mine, group=getattr(tp_group, "cpu_group", None))
    else:
        gathered = [mine]
    errors = [(r, g[2]) for r, g in enumerate(gathered) if g[2] is not None]
    if rank == 0 and not errors:
        files = [e for es, _, _ in gathered for e in (es or [])]
        ranks = sorted({e["rank"] for e in files})
        settings_ = next((st for _, st, _ in gathered if st), {"world_size": world})
        try:
            write_manifest(out, {"world_size": world, "ranks": ranks, "settings": settings_,
                                 "tool": f"tpprobe {__version__}", "source": source, "step": step,
                                 "forward_mode": mode, "model": type(model).__name__}, files)
        except Exception as e:  # noqa: BLE001 - rank 0's alone: logged once, the ranks keep capturing together
            if not _STEPS.get("manifest_failed"):
                _say(f"tp_rank 0: step {step} manifest NOT written (logged once): {type(e).__name__}: {e}")
            _STEPS["manifest_failed"] = True
            return []
    if errors:
        if rank == 0:
            _say(f"capture FAILED at step {step} ({mode}) on tp rank(s) {[r for r, _ in errors]}: {errors[0][1]}; "
                 f"the plugin stops capturing, the engine goes on")
        return errors
    _say(f"tp_rank {rank}: step {step} ({mode}) wrote {nbytes} bytes of kept tensors + fingerprints "
         f"-> {out}" + (f"; refused by TPPROBE_MAX_BYTES: {', '.join(budget.refused)}" if budget.refused else "")
         + (f"; check it with `tpprobe report {out}`" if rank == 0 else ""))
    return []
