"""The faults `--inject` knows, by name (torch-free: `tpprobe probe --help` lists them without
importing torch). What each fault does to the model lives in builtin/faults.py."""
from __future__ import annotations

# name -> (catalogue id, argument: "layer" | "rank" | None, argument required)
FAULTS = {
    "skip-embed-allreduce": ("F1", None, False),
    "skip-allreduce": ("F2", "layer", True),
    "subgroup-allreduce": ("F3", "layer", True),
    "rank-noise": ("F4", "rank", True),
    "rank-weight": ("F5", "rank", True),
    "slice-capture": ("F6", None, False),
    "capture-offset": ("F7", None, False),
    "drop-embed-slot": ("F8", None, False),
    "slot-order": ("F8", None, False),
    "alias-capture": ("F9", None, False),
    "nan": ("F10", "rank", True),
    "capture-dtype": ("F11", "rank", False),
    "capture-noncontig": ("F11", None, False),
    "extra-collective": ("F12", "rank", True),
    "embed-after-norm": ("F13", None, False),
    "kill-rank": ("F14", "rank", True),
    "hang-rank": ("F14", "rank", True),
    "drop-last-id": ("F15", None, False),
    # a reduce that runs and is wrong, or is missing where nothing vouches for it (F22-F25): on the
    # built-in model and, through GroupCoordinator.all_reduce, on SGLang's (tpprobe/engines/sglang/faults.py)
    "allreduce-scaled": ("F22", "layer", True),
    "allreduce-one-buffer": ("F22", "layer", True),
    "allreduce-stale": ("F22", "layer", True),
    "allreduce-rank": ("F23", "rank", True),
    "skip-allreduce-all": ("F24", None, False),
    "skip-unreadable-allreduce": ("F25", "layer", True),
    # SGLang's own model only (--engine sglang): tpprobe/engines/sglang/faults.py
    "fused-allreduce-capture": ("F16", None, False),
    "dp-attention-gather": ("F17", None, False),
    "capture-no-residual": ("F18", None, False),
    "embed-after-layer0": ("F13", None, False),
    # vLLM's own model only (--engine vllm): tpprobe/engines/vllm/faults.py
    "drop-final-id": ("F29", None, False),
    "aux-no-residual": ("F27", None, False),
    "deferred-reduce-capture": ("F28", "layer", True),
}
SGLANG_ONLY = ("fused-allreduce-capture", "dp-attention-gather", "capture-no-residual", "embed-after-layer0")
# the built-in model's faults SGLang's own models make too, the way its code would be wrong
# (tpprobe/engines/sglang/faults.py): a TP-sliced capture, an embedding without its all-reduce
SGLANG_TOO = ("slice-capture", "skip-embed-allreduce")
# vLLM's own model only (--engine vllm), beside the reduce faults below (tpprobe/engines/vllm/faults.py)
VLLM = ("drop-final-id", "aux-no-residual", "deferred-reduce-capture")
# faults both backends know (the built-in model's communicator; SGLang's GroupCoordinator)
BOTH = ("allreduce-scaled", "allreduce-one-buffer", "allreduce-stale", "allreduce-rank", "skip-allreduce-all",
        "skip-unreadable-allreduce", "skip-allreduce")


# SGLang's serving faults the built-in model makes too (the same wrong capture, in its own capture code)
BUILTIN_TOO = ("capture-no-residual",)


def inject_help() -> str:
    """--inject's help: every fault, and which take @K (a layer) or @R (a rank)."""
    names, sglang, vllm = [], [], []
    for name, (_, kind, required) in FAULTS.items():
        arg = {"layer": "@K", "rank": "@R"}.get(kind, "")
        shown = name + (arg if required else f"(optional {arg})" if arg else "")
        (sglang if name in SGLANG_ONLY else vllm if name in VLLM else names).append(shown)
    sglang += list(SGLANG_TOO)
    return ("break the built-in model on purpose, repeatable: NAME, NAME@K (K a layer) or NAME@R (R a rank), "
            "e.g. skip-allreduce@2 or nan@1; the reduce faults (F22-F25) also break SGLang's own models, and "
            "allreduce-scaled multiplies the sum by TPPROBE_INJECT_SCALE (default 2). What each looks like: "
            "docs/faults.md. Faults:\n\n\b\n" + _lines(names, 44)
            + "\n\n\b\nwith --engine sglang (capture-no-residual on the built-in model too; the last two\n"
              "are built-in faults SGLang's models make too):\n" + _lines(sglang, 44)
            + "\n\n\b\nwith --engine vllm only:\n" + _lines(vllm, 44))


def _lines(names: list[str], width: int) -> str:
    """The names a few to a line, never one cut in two (--help wraps text at its hyphens; a `\\b`
    paragraph is printed as written)."""
    out, cur = [], ""
    for n in names:
        if cur and len(cur) + len(n) + 2 > width:
            out.append(cur + ",")
            cur = n
        else:
            cur = f"{cur}, {n}" if cur else n
    return "\n".join(out + [cur])
