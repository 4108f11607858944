"""vLLM general plugin (`vllm.general_plugins` entry point `tpprobe`): capture a live engine's TP workers.

Declared in pyproject as `tpprobe = "tpprobe.engines.vllm.plugin:register"`. vLLM's
`load_general_plugins()` calls `register()` in every process (API server or LLM, engine core, each
worker), possibly more than once: `register()` is idempotent and does nothing (no extension named,
nothing wrapped) unless TPPROBE_CAPTURE_DIR is set.

Settings: the SGLang plugin's (tpprobe/engines/sglang/options.py PluginOptions: TPPROBE_CAPTURE_DIR,
TPPROBE_MAX_STEPS, TPPROBE_FORWARD_MODES, TPPROBE_KEEP, TPPROBE_KEEP_TOKENS, TPPROBE_MAX_BYTES,
TPPROBE_EMBED, TPPROBE_LAYER_LIST, TPPROBE_WATCH), meaning the same here; TPPROBE_SGLANG_MODELS is not read. The
forward modes are named as SGLang names them: `extend` (a forward with a prompt's first token in it:
prefill; a batch that mixes prefill and decode counts as extend) and `decode` (every other forward).
Test knobs (TPPROBE_VLLM_INJECT, TPPROBE_VLLM_AUX_LAYERS): tpprobe.engines.vllm.worker. A setting that
does not read (TPPROBE_MAX_STEPS=abc, an unknown mode, ...) is ONE line for the server and the plugin stays
off, nothing hooked (tpprobe.engines.sglang.options.plugin_settings): vLLM calls `register()` unguarded, so
nothing here may raise.

The rank-side work is vLLM's worker extension `tpprobe.engines.vllm.worker.TpprobeWorkerExtension`.
With TPPROBE_CAPTURE_DIR set, `register()` installs three small hooks:
  - config (the process that builds the engine's config: vLLM loads plugins in
    EngineArgs.__post_init__, before `create_engine_config`): when the user named no
    `worker_extension_cls`, the config is built with tpprobe's; a user's own extension is kept, and
    ONE log line says that the plugin attaches through the model loader instead;
  - engine core (`Executor.compile_or_warm_up_model`): once the workers have loaded and warmed up
    the model, `collective_rpc("tpprobe_attach")` when the extension is tpprobe's, so profile and
    warm-up forwards (and CUDA-graph capture) run without the Tap and step 0 is the first request's;
  - workers (`BaseModelLoader.load_model`): the fallback when the config names another extension
    (or none was injected): the loaded model is attached right away, whichever runner (V1 or V2)
    loads it.
Then `LLM.collective_rpc("tpprobe_status")` / `("tpprobe_capture", args=(n,))` answer from every
worker (the extension's methods).
"""
from __future__ import annotations

from tpprobe.engines.vllm.worker import attach, say, settings

EXTENSION = "tpprobe.engines.vllm.worker.TpprobeWorkerExtension"
# process-wide by nature: vLLM calls register() in every process, maybe more than once (idempotent)
_REGISTERED = {"done": False, "own_said": False}


def register() -> None:
    """Entry point: name tpprobe's worker extension in the engine's config and hook the attach, when
    TPPROBE_CAPTURE_DIR is set; else nothing. Idempotent."""
    try:
        s = settings()      # None: not capturing, or a setting refused (one line said: the plugin stays off)
    except Exception as e:  # noqa: BLE001 - vLLM calls plugins unguarded: nothing here may stop the engine
        say(f"vLLM plugin off: its settings could not be read: {type(e).__name__}: {e}")
        return
    if s is None or _REGISTERED["done"]:
        return
    _REGISTERED["done"] = True
    try:
        _hook_config()
        _hook_engine()
        _hook_loader()
        say(f"vLLM plugin registered: capture dir {s['dir']}, first {s['max_steps']} step(s) in modes "
            f"{sorted(s['modes'])}, <= {s['max_bytes']} bytes/rank")
    except Exception as e:  # noqa: BLE001
        say(f"vLLM plugin FAILED to register: {type(e).__name__}: {e}")


def _hook_config() -> None:
    """EngineArgs.create_engine_config builds the config with tpprobe's extension when the user named
    none (the user's EngineArgs is left as it was)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "_tpprobe", False):
        return
    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        own = self.worker_extension_cls
        if own and own != EXTENSION:
            if not _REGISTERED["own_said"]:
                _REGISTERED["own_said"] = True
                say(f"worker extension {own} named by the user: tpprobe's ({EXTENSION}) is not added, the "
                    f"plugin attaches through the model loader (the tpprobe_* collective_rpc calls answer only "
                    f"if {own} inherits it)")
            return orig(self, *args, **kwargs)
        self.worker_extension_cls = EXTENSION
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.worker_extension_cls = own

    create_engine_config._tpprobe = True
    EngineArgs.create_engine_config = create_engine_config


def _ours(parallel_config) -> bool:
    return getattr(parallel_config, "worker_extension_cls", "") == EXTENSION


def _hook_engine() -> None:
    """After the workers loaded and warmed up the model (the engine core's executor), attach through
    the extension on every worker."""
    from vllm.v1.executor.abstract import Executor

    if getattr(Executor.compile_or_warm_up_model, "_tpprobe", False):
        return
    orig = Executor.compile_or_warm_up_model

    def compile_or_warm_up_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if _ours(self.parallel_config):
            try:
                st = self.collective_rpc("tpprobe_attach")
                say("attached on every worker (collective_rpc tpprobe_attach): "
                    + ", ".join(f"tp_rank {x['tp_rank']}: {'yes' if x['attached'] else 'NO'}" for x in st))
            except Exception as e:  # noqa: BLE001 - the engine goes on without the probe
                say(f"could not attach through the worker extension: {type(e).__name__}: {e}")
        return out

    compile_or_warm_up_model._tpprobe = True
    Executor.compile_or_warm_up_model = compile_or_warm_up_model


def _hook_loader() -> None:
    """The fallback in the workers: a config naming another extension gets the model attached as it
    is loaded (BaseModelLoader.load_model, whichever runner loads it)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_tpprobe", False):
        return
    orig = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = orig(self, *args, **kwargs)
        try:
            if not _extension_attaches():
                attach(model)
        except Exception as e:  # noqa: BLE001 - the engine goes on without the probe
            say(f"could not attach to the model: {type(e).__name__}: {e}")
        return model

    load_model._tpprobe = True
    BaseModelLoader.load_model = load_model


def _extension_attaches() -> bool:
    """True when the config being loaded names tpprobe's extension (it attaches after warm-up)."""
    try:
        from vllm.config import get_current_vllm_config

        return _ours(get_current_vllm_config().parallel_config)
    except Exception:  # noqa: BLE001 - no config to read: attach here
        return False
