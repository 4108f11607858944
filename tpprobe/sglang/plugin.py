"""SGLang general plugin (`sglang.srt.plugins` entry point `tpprobe`): capture live TP ranks.

Declared in pyproject as `tpprobe = "tpprobe.sglang.plugin:register"`. SGLang's `load_plugins()`
calls `register()` in every process that loads plugins (engine, each scheduler = TP/PP rank
worker, DP controller, detokenizer). Nothing happens unless TPPROBE_CAPTURE_DIR is set.

Settings (environment):
  TPPROBE_CAPTURE_DIR    folder to write to (required to enable anything)
  TPPROBE_MAX_STEPS      forward steps to capture per rank (default 1); step s goes to DIR/step-SSS
  TPPROBE_FORWARD_MODES  comma list of ForwardMode names to capture (default "extend")
  TPPROBE_MAX_BYTES      stop capturing once this many bytes were written by a rank (default 2e9)
  TPPROBE_SGLANG_MODELS  comma list of dotted `Class.forward` targets to wrap (default: SGLang's
                         LlamaForCausalLM and DeepseekV2ForCausalLM; DeepseekV3 inherits it)

Per captured forward, inside the model's own forward, each TP rank runs tpprobe's `Tap`
(embedding, decoder layers, every torch.distributed.all_reduce) and writes `rank-NNN.safetensors`
+ `rank-NNN.json` with `tpprobe.capture.write_rank`; TP rank 0 gathers the file entries over the
TP group's CPU (gloo) group and writes `manifest.json`, so `tpprobe report DIR/step-000` runs the
cross-rank checks offline.

SGLang 0.5.23 decoder layers return an opaque `OwedOutput` (the MLP's partial sum, reduced at the
next layer's input), so a forward hook on a layer cannot see the residual stream. The plugin
therefore also hands each layer's `attn_boundary.prepare` a `capture` callback (SGLang's own
EAGLE-3 capture mechanism): `resid.K` = the residual stream entering layer K = HF
hidden_states[K] (K = 0: embedding output). This completes the owed reduce at that point, as
EAGLE-3 capture does; values are unchanged.

SGLang logs and swallows plugin exceptions, so this plugin prints its own state loudly: one
`[tpprobe]` line per rank when it hooks, and one per written or skipped step.

GPU path: this module never imports tpprobe.sglang.cpu_mode.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

ENV_DIR = "TPPROBE_CAPTURE_DIR"
DEFAULT_TARGETS = (
    "sglang.srt.models.llama.LlamaForCausalLM.forward",
    "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.forward",
)

_state = threading.local()
_STEPS = {"n": 0, "bytes": 0, "announced": False}


def _say(msg: str) -> None:
    print(f"[tpprobe pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def settings() -> Optional[dict]:
    d = os.environ.get(ENV_DIR)
    if not d:
        return None
    return {
        "dir": Path(d),
        "max_steps": int(os.environ.get("TPPROBE_MAX_STEPS", "1")),
        "modes": {m.strip().lower() for m in os.environ.get("TPPROBE_FORWARD_MODES", "extend").split(",")
                  if m.strip()},
        "max_bytes": int(float(os.environ.get("TPPROBE_MAX_BYTES", "2e9"))),
        "targets": [t.strip() for t in os.environ.get("TPPROBE_SGLANG_MODELS", "").split(",") if t.strip()]
        or list(DEFAULT_TARGETS),
    }


def register() -> None:
    """Entry point: register the AROUND hooks when TPPROBE_CAPTURE_DIR is set; else nothing."""
    s = settings()
    if s is None:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target in s["targets"]:
            HookRegistry.register(target, _around_forward, HookType.AROUND)
        _say(f"plugin registered: will wrap {', '.join(s['targets'])}; capture dir {s['dir']}, "
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


def _around_forward(original_fn, self, input_ids, positions, forward_batch, *args, **kwargs):
    s = settings()
    if s is None or getattr(_state, "busy", False):
        return original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    mode = _mode_name(forward_batch)
    step = _STEPS["n"]
    if step >= s["max_steps"] or mode not in s["modes"] or _STEPS["bytes"] >= s["max_bytes"]:
        return original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    from tpprobe.hooks import Tap

    rank, world, tp_group = _tp()
    layers = list(getattr(getattr(self, "model", None), "layers", []) or [])
    resid: dict[int, torch.Tensor] = {}
    undo = _wrap_boundaries(layers, resid)
    if not _STEPS["announced"]:
        _STEPS["announced"] = True
        _say(f"tp_rank {rank}/{world}: hooking {type(self).__name__} (VocabParallelEmbedding, "
             f"{len(layers)} decoder layers, torch.distributed.all_reduce, residual stream at "
             f"{sum(1 for u in undo if u)} layer inputs) -> {s['dir']}")
    _state.busy = True
    try:
        with Tap(self) as tap:
            result = original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        _state.busy = False
        for u in undo:
            if u:
                u()
    _STEPS["n"] += 1
    try:
        _write_step(s, step, mode, rank, world, tp_group, tap, resid, input_ids, result, self)
    except Exception as e:  # noqa: BLE001
        _say(f"tp_rank {rank}: step {step} NOT written: {type(e).__name__}: {e}")
    return result


def _wrap_boundaries(layers, resid: dict):
    """Give each layer's attention boundary a capture callback; return undo functions."""
    undo = []
    for i, layer in enumerate(layers):
        b = getattr(layer, "attn_boundary", None)
        if b is None or not hasattr(b, "prepare"):
            undo.append(None)
            continue
        orig = b.prepare

        def prepare(hidden_states, forward_batch, *a, _i=i, _orig=orig, **call):
            theirs = call.pop("capture", None)

            def both(value, owned=False, _theirs=theirs):
                resid[_i] = value.detach().clone()
                if _theirs is not None:
                    _theirs(value, owned=owned)

            return _orig(hidden_states, forward_batch, *a, capture=both, **call)

        try:
            b.prepare = prepare
        except (AttributeError, TypeError):
            undo.append(None)
            continue
        undo.append(lambda b=b: b.__dict__.pop("prepare", None))
    return undo


def _write_step(s, step, mode, rank, world, tp_group, tap, resid, input_ids, result, model) -> None:
    from tpprobe.capture import write_manifest, write_rank

    out = s["dir"] / f"step-{step:03d}"
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {k: v for k, v in tap.captures.items()
                                        if isinstance(v, torch.Tensor)}
    for i, t in resid.items():
        tensors[f"resid.{i}"] = t
    for a in tap.allreduces:
        if a.inp is not None:
            tensors[f"allreduce.{a.seq}.in"] = a.inp
        if a.out is not None:
            tensors[f"allreduce.{a.seq}.out"] = a.out
    aux = getattr(result, "hidden_states", None)
    if isinstance(aux, torch.Tensor):
        tensors["aux.packed"] = aux
    tensors["input_ids"] = input_ids
    seen = set()
    for k, t in list(tensors.items()):   # safetensors refuses shared storage: copy repeats
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        tensors[k] = t.clone() if key in seen else t
        seen.add(key)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    entries: list = []
    if _STEPS["bytes"] + nbytes > s["max_bytes"]:
        _STEPS["bytes"] = s["max_bytes"]
        _say(f"tp_rank {rank}: step {step} skipped: {nbytes} bytes would pass TPPROBE_MAX_BYTES; "
             f"capture stopped")
    else:
        _STEPS["bytes"] += nbytes
        meta = {
            "source": "sglang-plugin", "status": "ok", "rank": rank, "world_size": world,
            "step": step, "forward_mode": mode, "model": type(model).__name__,
            "points": list(tap.order), "resid_layers": sorted(resid),
            "layers_to_capture": list(getattr(getattr(model, "model", None), "layers_to_capture", []) or []),
            "allreduces": [a.meta() for a in tap.allreduces],
            "unreduced_rows": tap.unreduced_rows(),
        }
        try:
            entries = write_rank(out, rank, tensors, meta)
        except Exception as e:  # noqa: BLE001 - still join the gather below, or rank 0 hangs
            _say(f"tp_rank {rank}: step {step} NOT written: {type(e).__name__}: {e}")
    # TP rank 0 writes the manifest from every rank's entries (gathered over the gloo CPU group)
    gathered = [None] * world if rank == 0 else None
    group = getattr(tp_group, "cpu_group", None)
    if world > 1:
        torch.distributed.gather_object(entries, gathered, dst=_global_rank0(tp_group), group=group)
    else:
        gathered = [entries]
    if rank == 0:
        files = [e for es in gathered for e in (es or [])]
        write_manifest(out, {"world_size": world, "source": "sglang-plugin", "step": step,
                             "forward_mode": mode, "model": type(model).__name__}, files)
    _say(f"tp_rank {rank}: step {step} ({mode}) wrote {len(tensors)} tensors, {nbytes} bytes -> {out}")


def _global_rank0(tp_group) -> int:
    ranks = getattr(tp_group, "ranks", None)
    return ranks[0] if ranks else 0
