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
(embedding, decoder layers, every torch.distributed.all_reduce) with the SGLang extensions of
`tpprobe.sglang.stream`, and writes `rank-NNN.safetensors` + `rank-NNN.json` with
`tpprobe.capture.write_rank`, using the point names and metadata keys `tpprobe probe` writes
(`embed.local`, `embed.out`, `layer.K.out` = the residual stream leaving layer K = HF
hidden_states[K+1], `aux.packed`, `allreduce.N.in/.out`, `input_ids`). TP rank 0 gathers the file
entries over the TP group's CPU (gloo) group and writes `manifest.json` whose `settings` carry
world_size, dtype, hidden, num_layers and the slot expectations derived from the live model's
`layers_to_capture` (layer_ids / expected_points / expected_ids), so `tpprobe report
DIR/step-000` runs the same cross-rank checks offline.

SGLang 0.5.23 decoder layers return an opaque `OwedOutput` (the MLP's partial sum, reduced at the
next layer's input), so a forward hook on a layer cannot see the residual stream: the extension
hands each layer's `attn_boundary.prepare` a `capture` callback (SGLang's own EAGLE-3 capture
mechanism; it completes the owed reduce at that boundary, as EAGLE-3 capture does; values are
unchanged, the fused all-reduce+norm kernel is not used for that boundary) and reads the last
layer's stream from the final norm.

SGLang logs and swallows plugin exceptions, so this plugin prints its own state loudly: one
`[tpprobe]` line per rank when it hooks, and one per written or skipped step.

GPU path: this module never imports tpprobe.sglang.cpu_mode.
"""
from __future__ import annotations

import os
import sys
import threading
import time
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
    from tpprobe.capture.hooks import Tap
    from tpprobe.sglang.stream import decoder_layers, sglang_extensions

    rank, world, tp_group = _tp()
    layers = decoder_layers(self)
    if not _STEPS["announced"]:
        _STEPS["announced"] = True
        _say(f"tp_rank {rank}/{world}: hooking {type(self).__name__} (VocabParallelEmbedding, "
             f"{len(layers)} decoder layers, torch.distributed.all_reduce, the residual stream at "
             f"every layer boundary and the final norm) -> {s['dir']}")
    _state.busy = True
    t0 = time.time()
    try:
        with torch.no_grad(), Tap(self, extensions=sglang_extensions()) as tap:
            tap.stream_from_layer_output = False    # 0.5.23 layers return an owed output
            result = original_fn(self, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        _state.busy = False
    t_forward = time.time() - t0
    _STEPS["n"] += 1
    _write_step(s, step, mode, rank, world, tp_group, tap, input_ids, result, self, t_forward)
    return result


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


def _step_record(s, step, mode, rank, world, tap, input_ids, result, model, t_forward):
    """This rank's tensors, metadata (the keys `tpprobe probe` writes) and run settings."""
    from tpprobe.tools.layers import slots_from_layers_to_capture
    from tpprobe.capture.params import replicated_param_hashes

    tensors: dict[str, torch.Tensor] = {k: v for k, v in tap.captures.items() if isinstance(v, torch.Tensor)}
    for a in tap.allreduces:
        if a.inp is not None and a.out is not None:
            tensors[f"allreduce.{a.seq}.in"], tensors[f"allreduce.{a.seq}.out"] = a.inp, a.out
    tensors["input_ids"] = input_ids
    aux, aux_note = _aux(result, int(input_ids.shape[0]))
    aux_meta = {}
    if aux is not None:
        tensors["aux.packed"] = aux
        aux_meta = {"shape": list(aux.shape), "dtype": str(aux.dtype).replace("torch.", ""),
                    "contiguous": aux.is_contiguous(), "stride": list(aux.stride())}
    seen = set()
    for k, t in list(tensors.items()):   # safetensors refuses shared storage: copy repeats
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        tensors[k] = t.clone() if key in seen else t
        seen.add(key)
    config = getattr(model, "config", None)
    L = len(tap.layer_indices)
    ltc = list(getattr(getattr(model, "model", None), "layers_to_capture", []) or [])
    points, ids = slots_from_layers_to_capture(ltc, L) if aux is not None else ([], [])
    dtype = next((t.dtype for n, t in tensors.items() if n == "embed.out"), None) or \
        next(iter(model.parameters())).dtype
    meta = {
        "rank": rank, "world_size": world, "status": "ok", "error": None,
        "points": [{"name": n, "shape": list(tensors[n].shape), "dtype": str(tensors[n].dtype).replace("torch.", "")}
                   for n in tap.order if n in tensors],
        "allreduces": [a.meta() for a in tap.allreduces], "unreduced_rows": tap.unreduced_rows(),
        "embed_module": tap.embed_name, "layers_hooked": L,
        "aux": aux_meta, "params": replicated_param_hashes(model),
        "timings": {"forward_s": t_forward}, "device": str(input_ids.device),
        # plugin-only facts
        "source": "sglang-plugin", "step": step, "forward_mode": mode, "model": type(model).__name__,
        "layers_to_capture": ltc, "aux_note": aux_note,
    }
    run_settings = {
        "world_size": world, "backend": "sglang (live server, plugin)",
        "dtype": str(dtype).replace("torch.", ""),
        "hidden": int(getattr(config, "hidden_size", 0) or tensors.get("embed.out", torch.empty(0, 0)).shape[-1]),
        "num_layers": L, "tokens": int(input_ids.numel()),
        "arch": str(getattr(config, "model_type", type(model).__name__)),
        "model": type(model).__name__, "layer_ids": ids, "expected_points": points, "expected_ids": ids,
        "sglang layers_to_capture": str(ltc), "forward_mode": mode, "step": step,
    }
    return tensors, meta, run_settings


def _write_step(s, step, mode, rank, world, tp_group, tap, input_ids, result, model, t_forward) -> None:
    """Write this rank's files; TP rank 0 writes the manifest. Every rank ALWAYS joins the gather
    (also when its own write failed), so one rank's error never hangs the others."""
    from tpprobe import __version__
    from tpprobe.capture.files import write_manifest, write_rank

    out = s["dir"] / f"step-{step:03d}"
    entries: list = []
    run_settings: dict = {}
    nbytes = 0
    try:
        out.mkdir(parents=True, exist_ok=True)
        tensors, meta, run_settings = _step_record(s, step, mode, rank, world, tap, input_ids, result,
                                                   model, t_forward)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if _STEPS["bytes"] + nbytes > s["max_bytes"]:
            _STEPS["bytes"] = s["max_bytes"]
            _say(f"tp_rank {rank}: step {step} skipped: {nbytes} bytes would pass TPPROBE_MAX_BYTES; "
                 f"capture stopped")
        else:
            _STEPS["bytes"] += nbytes
            entries = write_rank(out, rank, tensors, meta)
    except Exception as e:  # noqa: BLE001 - SGLang would swallow it; still join the gather below
        _say(f"tp_rank {rank}: step {step} NOT written: {type(e).__name__}: {e}")
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        group = getattr(tp_group, "cpu_group", None)
        torch.distributed.gather_object((entries, run_settings), gathered, dst=_global_rank0(tp_group), group=group)
    else:
        gathered = [(entries, run_settings)]
    if rank == 0:
        files = [e for es, _ in gathered for e in (es or [])]
        ranks = sorted({e["rank"] for e in files})
        settings_ = next((st for _, st in gathered if st), {"world_size": world})
        try:
            write_manifest(out, {"world_size": world, "ranks": ranks, "settings": settings_,
                                 "tool": f"tpprobe {__version__}", "source": "sglang-plugin", "step": step,
                                 "forward_mode": mode, "model": type(model).__name__}, files)
        except Exception as e:  # noqa: BLE001
            _say(f"tp_rank 0: step {step} manifest NOT written: {type(e).__name__}: {e}")
            return
    if entries:
        _say(f"tp_rank {rank}: step {step} ({mode}) wrote {nbytes} bytes -> {out}"
             + (f"; check it with `tpprobe report {out}`" if rank == 0 else ""))


def _global_rank0(tp_group) -> int:
    ranks = getattr(tp_group, "ranks", None)
    return ranks[0] if ranks else 0
