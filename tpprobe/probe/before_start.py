"""What the launcher says before any rank starts and before any engine is imported (SGLang and vLLM
take tens of seconds to import): a --config that is no JSON config, and a default id list the
model's depth shortened (a 3-slot contract becoming 1 slot is said, never silent)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..core.errors import UsageError


def check_config_file(path: Optional[str]) -> None:
    """--config: a readable JSON object (a HF config.json or its folder), else UsageError in one line."""
    if path is None:
        return
    p = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e}); give a HF config.json or its "
                         f"folder") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--config {path}: cannot read a JSON config ({e}); give a HF config.json") from None
    if not isinstance(d, dict):
        raise UsageError(f"--config {path}: not a JSON object; expected a HF config.json")


def full_default_ids(opts) -> list[int]:
    """The default ids of a deep model of this arch (what a user reads in --help: -1,1,3 or 0,2,4)."""
    from ..config.options import builtin_layer_ids
    if opts.backend == "sglang" or (opts.backend == "vllm" and opts.arch in ("deepseek_v2", "deepseek_v3",
                                                                             "kimi_k2")):
        from ..engines.sglang.tiny_archs import default_layer_ids
        return default_layer_ids(opts.arch, 64)
    return builtin_layer_ids(64)


def default_ids_note(opts) -> Optional[str]:
    """One line when the default ids were cut to fit the model's depth, else None (ids given, or a
    --model factory, whose depth the ranks learn)."""
    if opts.layers_given or opts.model:
        return None
    full = full_default_ids(opts)
    got = list(opts.layers)
    if got == full:
        return None
    n = len(got)
    return (f"tpprobe: note: a {opts.num_layers}-layer model: the default ids are {','.join(map(str, got))} "
            f"({n} slot{'s' if n != 1 else ''}), not {','.join(map(str, full))} ({len(full)} slots): fitted to "
            f"this depth; give --layers to choose")
