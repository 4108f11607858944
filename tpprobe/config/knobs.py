"""Every TPPROBE_* environment variable tpprobe reads, declared once: its default and meaning.

The SGLang plugin's settings (TPPROBE_CAPTURE_DIR, TPPROBE_MAX_STEPS, ...) are declared with their
parsing in `tpprobe/engines/sglang/options.py` (`PluginOptions`); everything else is here, and code
reads it with `knob(NAME)`, never `os.environ` directly (tests/house/test_knobs.py holds that, and that the
tables in docs/, written by `python scripts/knobs_table.py --write`, list every one)."""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Knob:
    default: Optional[str]      # None: unset
    meaning: str
    who: str                    # who reads it, as the docs' tables say


KNOBS = {
    "TPPROBE_FINGERPRINT_TORCH": Knob(None, "set: fingerprints computed with the PyTorch reference instead of the "
                                      "Triton kernels (GPU)", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_HOST_COMBINE": Knob(None, "set: the fused fingerprints' partials are combined on the host, not the "
                                    "device (GPU)", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_JIT": Knob(None, "set: launch the Triton kernels through JITFunction.run, not the direct C launch "
                           "(which is taken only on the Triton releases FAST_PATHS names)",
                           "probe, plugin (diagnosis)"),
    "TPPROBE_NATIVE": Knob("1", "0: no C module: every fingerprint launch queued and every all-reduce recorded "
                           "from Python (the module, fingerprint/triton/native.c, is built with Triton's own builder "
                           "where the direct launch is taken)", "probe, plugin (diagnosis)"),
    "TPPROBE_FAST_HOOKS": Knob("1", "0: the Tap registers its hooks through torch's public register_forward_* API "
                               "(the fast path writes torch's private hook dicts, only on the torch releases "
                               "FAST_PATHS names)", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_BLOCK_R": Knob("16", "Triton fingerprint kernel: rows per block", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_WARPS": Knob("4", "Triton fingerprint kernel: warps per program", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_PROGS": Knob("3", "Triton fingerprint kernel: programs per SM", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_MAXNREG": Knob("144", "Triton fingerprint kernel: register cap", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_SPLIT": Knob("2", "Triton fingerprint kernel: split of a row's columns", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_DEPTH": Knob("3", "Triton fingerprint kernel: loads in flight", "probe, plugin (diagnosis)"),
    "TPPROBE_AUDIT_DOORS": Knob("1", "0: the audit records every collective through its dispatcher kernel, not at "
                                "ProcessGroup's Python methods", "probe, plugin (diagnosis)"),
    "TPPROBE_STACKS_AFTER": Knob(None, "S: dump every thread's stack if a rank still runs after S seconds",
                                 "probe, plugin (diagnosis)"),
    "TPPROBE_GLOO_CUDA": Knob(None, "set: gloo ranks keep their tensors on the GPU (one GPU, several ranks)", "probe"),
    "TPPROBE_INJECT_SCALE": Knob("2", "the factor a wrong-sum --inject (allreduce-scaled) multiplies the sum by",
                                 "probe"),
    "TPPROBE_VLLM_ALLREDUCE": Knob("shm", "--engine vllm on CPU: the path vLLM's TP all-reduce takes, shm (its "
                                   "shared-memory _C.shm_allreduce, what its CPU engine takes) or gloo (its "
                                   "torch.distributed fallback)", "probe"),
    "TPPROBE_VLLM_INJECT": Knob(None, "tests only: the vLLM plugin breaks the model it attaches to with one of "
                                "tpprobe.engines.vllm.faults' faults (NAME or NAME@K, e.g. skip-allreduce@1) or "
                                "aux-no-residual; plugin-error@R raises in the plugin's own capture code on TP "
                                "rank R (the engine must go on)", "plugin (tests)"),
    "TPPROBE_VLLM_AUX_LAYERS": Knob(None, "the vLLM plugin asks the model's EAGLE-3 capture for these tpprobe layer "
                                    "ids (comma list; i = the stream leaving layer i, -1 = the embedding) on an engine "
                                    "with no draft model, checks the packed aux slot by slot and hands the runner the "
                                    "hidden states only (tests)", "plugin (tests)"),
    "TPPROBE_RANK_START": Knob("auto", "how `tpprobe probe` starts its local ranks: auto (fork CPU gloo ranks from "
                               "the launcher, which has torch imported already; spawn them through PyTorch's "
                               "elastic agent otherwise), fork, or spawn", "probe"),
    "TPPROBE_DRAFT_TRAINED": Knob(None, "what the EAGLE-3 draft was trained on: ids:A,B,C (the HF hidden_states "
                                  "indices, in slot order), convention:NAME or specforge:PATH (a SpecForge sample, "
                                  "matched to a captured prefill of its tokens); the draft's input is checked against "
                                  "it (tpprobe.engines.draft_training)", "plugin, report"),
    "TPPROBE_ID_RULE": Knob(None, "a patched engine build's capture of some EAGLE-3 ids, ID=WHAT comma list (e.g. "
                            "-1=embed; WHAT: embed, out:K, in:K or hs:N); `layers`, `fix` and both plugins read it "
                            "(tpprobe.engines.capture_rule)", "plugin, layers, fix"),
    "TPPROBE_FIX_REPLAY": Knob(None, "1: `tpprobe report` of a live vLLM or SGLang capture with the draft's input "
                               "replays the draft on candidate ids even when the engine's acceptance is not low",
                               "report"),
    "TPPROBE_STOP_GRACE_S": Knob("30", "seconds between the SIGTERM the launcher sends the other ranks when one "
                                 "fails and the SIGKILL that ends those still running", "probe"),
    "TPPROBE_SETTINGS_REFUSED": Knob(None, "the line a plugin said when it refused a setting and stayed off, left for "
                                     "the processes the engine starts, so the server says it once (set by the "
                                     "plugins themselves)", "internal"),
    "TPPROBE_DIST_BACKEND": Knob(None, "the launcher's one backend decision, passed to every rank (set by tpprobe "
                                 "probe itself)", "internal"),
}


@dataclass(frozen=True)
class FastPath:
    """A fast path through a package's private internals, taken only on the releases it was verified
    on (lowest <= major.minor < below) and while its knob allows it; the public path otherwise."""
    package: str                # the distribution whose version decides
    lowest: tuple               # (major, minor), included
    below: tuple                # (major, minor), excluded
    knob: str                   # the TPPROBE_* variable that switches it
    knob_allows: bool           # whether "set" (knob_set) allows it (True) or forbids it (False)
    what: str


# The one place the private internals tpprobe touches are pinned to releases: tests/ranks/test_fast_paths.py.
FAST_PATHS = {
    "hooks": FastPath("torch", (2, 11), (2, 14), "TPPROBE_FAST_HOOKS", True,
                      "the Tap writes torch.nn.Module's private hook dicts and swaps a hookless module's forward"),
    "launch": FastPath("triton", (3, 6), (3, 7), "TPPROBE_FP_JIT", False,
                       "the fingerprint kernels are launched through their CompiledKernel's launcher (Triton 3.6's "
                       "C launch), not JITFunction.run"),
}


@functools.lru_cache(maxsize=64)
def release(version: str) -> tuple:
    """(major, minor) of a version string ("2.13.0+cpu" -> (2, 13), "3.6.0rc1" -> (3, 6)); () when unreadable.
    Kept per string: every Tap asks for torch's at its enter."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else ()


def fast_path_refused(name: str, version: str) -> str:
    """Why the fast path `name` is not taken with this installed version ("" when it is)."""
    fp = FAST_PATHS[name]
    if knob_set(fp.knob) != fp.knob_allows:
        return f"{fp.knob}={knob(fp.knob) or ''}"
    r = release(version)
    if not r or not fp.lowest <= r < fp.below:
        return (f"{fp.package} {version} is outside {'.'.join(map(str, fp.lowest))} to "
                f"{'.'.join(map(str, fp.below))} (exclusive)")
    return ""


def knob(name: str) -> Optional[str]:
    """The variable's value, else its declared default (a name not declared above is a bug)."""
    return os.environ.get(name, KNOBS[name].default)


# the variables read as numbers, and as which: set to anything else, they are one line and exit 2 before any
# rank starts (check_numeric_knobs), never a rank's ValueError
NUMERIC = {"TPPROBE_FP_BLOCK_R": int, "TPPROBE_FP_WARPS": int, "TPPROBE_FP_PROGS": int, "TPPROBE_FP_MAXNREG": int,
           "TPPROBE_FP_SPLIT": int, "TPPROBE_FP_DEPTH": int, "TPPROBE_INJECT_SCALE": float,
           "TPPROBE_STOP_GRACE_S": float, "TPPROBE_STACKS_AFTER": float}


def knob_int(name: str) -> int:
    return int(_number(name))


def knob_float(name: str) -> float:
    return float(_number(name))


def _number(name: str):
    v = os.environ.get(name) or KNOBS[name].default      # set but empty: the default, as unset
    kind = NUMERIC[name]
    try:
        x = kind(v)
        if not math.isfinite(x):
            raise ValueError(v)
        return x
    except (TypeError, ValueError):
        from ..core.errors import UsageError
        want = "an integer" if kind is int else "a finite number"
        raise UsageError(f"{name}={v!r}: not {want} ({KNOBS[name].meaning}; default {KNOBS[name].default})")


def check_numeric_knobs(reader: Optional[str] = None) -> None:
    """Every variable read as a number that is set must be one: one clear line before any rank starts.
    `reader`: only those whose `who` names it (the plugins check theirs, "plugin", before they turn on)."""
    for name in NUMERIC:
        if os.environ.get(name) and (reader is None or reader in KNOBS[name].who):
            _number(name)


def knob_set(name: str) -> bool:
    """Set to anything but "" or "0"."""
    v = knob(name)
    return bool(v) and v != "0"
