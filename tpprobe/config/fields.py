"""How an option is declared once: `opt` gives a dataclass field its flag, default, help and how it is
read from (and written back to) the command line or the environment. The probe's options
(config/options.py), the invariance grid's and the SGLang plugin's settings are declared with it."""
from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any, Callable, Optional


def opt(flag: str, default: Any, help: str, *, cli_type: Any = None, parse: Optional[Callable] = None,
        show: Optional[Callable] = None, cli_default: Any = MISSING, env: Optional[str] = None):
    """One option: its flag, default and help; `cli_type` the type typer parses (an Enum lists its
    choices in --help), `parse` from that to the field, `show` from the field back to argv text,
    `cli_default` when the command line's default differs (None = resolved later), `env` the
    environment variable that sets it (plugin settings)."""
    meta = {"flag": flag, "help": help, "cli_type": cli_type, "parse": parse, "show": show,
            "cli_default": cli_default, "env": env}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
