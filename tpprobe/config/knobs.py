"""Every TPPROBE_* environment variable tpprobe reads, declared once: its default and meaning.

The SGLang plugin's settings (TPPROBE_CAPTURE_DIR, TPPROBE_MAX_STEPS, ...) are declared with their
parsing in `tpprobe/engines/sglang/options.py` (`PluginOptions`); everything else is here, and code
reads it with `knob(NAME)`, never `os.environ` directly (tests/test_knobs.py holds that, and that the
README's table, `python scripts/knobs_table.py --write`, lists every one)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Knob:
    default: Optional[str]      # None: unset
    meaning: str
    who: str                    # who reads it, as the README's table says


KNOBS = {
    "TPPROBE_FINGERPRINT_TORCH": Knob(None, "set: fingerprints computed with the PyTorch reference instead of the "
                                      "Triton kernels (GPU)", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_HOST_COMBINE": Knob(None, "set: the fused fingerprints' partials are combined on the host, not the "
                                    "device (GPU)", "probe, plugin (diagnosis)"),
    "TPPROBE_FP_JIT": Knob(None, "set: launch the Triton kernels through JITFunction.run, not the direct C launch",
                           "probe, plugin (diagnosis)"),
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
    "TPPROBE_VLLM_ALLREDUCE": Knob("shm", "--backend vllm on CPU: the path vLLM's TP all-reduce takes, shm (its "
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
    "TPPROBE_DIST_BACKEND": Knob(None, "the launcher's one backend decision, passed to every rank (set by tpprobe "
                                 "probe itself)", "internal"),
}


def knob(name: str) -> Optional[str]:
    """The variable's value, else its declared default (a name not declared above is a bug)."""
    return os.environ.get(name, KNOBS[name].default)


def knob_int(name: str) -> int:
    return int(knob(name))


def knob_set(name: str) -> bool:
    """Set to anything but "" or "0"."""
    v = knob(name)
    return bool(v) and v != "0"
