"""The tables of every TPPROBE_* variable, from their one declaration: `tpprobe/engines/sglang/options.py`
PluginOptions (the plugins' settings) and `tpprobe/config/knobs.py` KNOBS. A user's variables go to
docs/configuration.md; those for diagnosing tpprobe, for its tests and its internal ones to docs/development.md.

  python scripts/knobs_table.py            # print both
  python scripts/knobs_table.py --write    # replace both pages' tables (between the markers)

tests/house/test_knobs.py fails when a page's table differs from this."""
from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import readme_section  # noqa: E402

USER_PAGE, DEV_PAGE = ROOT / "docs" / "configuration.md", ROOT / "docs" / "development.md"
BEGIN, END = "<!-- knobs:begin (python scripts/knobs_table.py --write) -->", "<!-- knobs:end -->"
DEV_BEGIN, DEV_END = "<!-- devknobs:begin (python scripts/knobs_table.py --write) -->", "<!-- devknobs:end -->"
DEV_READERS = ("(diagnosis)", "(tests)", "internal")   # a `read by` naming one of these is a development variable


def rows() -> list[tuple[str, str, str, str]]:
    from tpprobe.config.knobs import KNOBS
    from tpprobe.engines.sglang.options import PluginOptions
    out = []
    for f in fields(PluginOptions):
        d = f.default
        shown = "unset" if d in (None, "") else (f"{d:.0e}".replace("+0", "") if isinstance(d, float) else str(d))
        who = "SGLang plugin" if f.metadata["env"] == "TPPROBE_SGLANG_MODELS" else "SGLang and vLLM plugins"
        out.append((f.metadata["env"], who, shown, f.metadata["help"]))
    for name, k in KNOBS.items():
        out.append((name, k.who, "unset" if k.default is None else k.default, k.meaning))
    return out


def is_dev(who: str) -> bool:
    return any(w in who for w in DEV_READERS)


def table(dev: bool = False) -> str:
    lines = ["| variable | read by | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {who} | {d} | {m.replace('|', '/')} |" for n, who, d, m in rows() if is_dev(who) == dev]
    return "\n".join(lines)


def page_table(text: str, dev: bool = False) -> str:
    return readme_section.section(text, *((DEV_BEGIN, DEV_END) if dev else (BEGIN, END)))


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme_section.write(BEGIN, END, table(), USER_PAGE)
        readme_section.write(DEV_BEGIN, DEV_END, table(dev=True), DEV_PAGE)
    else:
        print(table(), table(dev=True), sep="\n\n")
