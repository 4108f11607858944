"""The README's table of every TPPROBE_* variable (the SGLang plugin's settings, then the rest),
from their one declaration: `tpprobe/engines/sglang/options.py` PluginOptions and `tpprobe/config/knobs.py` KNOBS.

  python scripts/knobs_table.py            # print it
  python scripts/knobs_table.py --write    # replace the README's table (between the markers)

tests/test_knobs.py fails when the README's table differs from this."""
from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import readme_section  # noqa: E402
BEGIN, END = "<!-- knobs:begin (python scripts/knobs_table.py --write) -->", "<!-- knobs:end -->"


def rows() -> list[tuple[str, str, str, str]]:
    from tpprobe.config.knobs import KNOBS
    from tpprobe.engines.sglang.options import PluginOptions
    out = []
    for f in fields(PluginOptions):
        d = f.default
        shown = "unset" if d in (None, "") else (f"{d:.0e}".replace("+0", "") if isinstance(d, float) else str(d))
        out.append((f.metadata["env"], "SGLang plugin", shown, f.metadata["help"]))
    for name, k in KNOBS.items():
        out.append((name, k.who, "unset" if k.default is None else k.default, k.meaning))
    return out


def table() -> str:
    lines = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {who} | {d} | {m.replace('|', '/')} |" for n, who, d, m in rows()]
    return "\n".join(lines)


def readme_table(text: str) -> str:
    return readme_section.section(text, BEGIN, END)


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme_section.write(BEGIN, END, table())
    else:
        print(table())
