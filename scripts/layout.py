"""The Layout section of docs/architecture.md, generated from the tree: every wing (subpackage) of tpprobe, top floor
first (import_graph.FLOORS), and every module in it with the first sentence of its docstring.

  python scripts/layout.py            # print it
  python scripts/layout.py --write    # replace the page's section (between the markers)

tests/house/test_house.py fails when the page's section differs from this, so a module added, moved or
renamed without `--write` is caught, and so is a module without a docstring."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402
import readme_section  # noqa: E402

PAGE = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- layout:begin (python scripts/layout.py --write) -->", "<!-- layout:end -->"
NAME = 24          # the width of the name column (a longer name keeps one space before its line)
WIDTH = 120        # the widest line


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring (its first paragraph, joined), "" without one."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", para)
    text = m.group(1) if m else para
    room = WIDTH - NAME
    if len(text) > room:
        text = text[:room - 1].rsplit(" ", 1)[0] + " …"
    return text


def section() -> str:
    mods = import_graph.modules()
    pkg_root = ROOT / "tpprobe"
    wings: dict[str, list[str]] = {}
    for m, path in mods.items():
        rel = path.relative_to(pkg_root)
        wing = rel.parts[0] if len(rel.parts) > 1 else ""
        wings.setdefault(wing, []).append(m)
    order = sorted(wings, key=lambda w: (w != "", import_graph.LEVEL.get(w, len(import_graph.FLOORS)), w))
    out = []
    for w in order:
        files = sorted(mods[m] for m in wings[w])
        if w:
            out.append(f"{('tpprobe/' + w + '/'):<{NAME - 1}} {first_sentence(pkg_root / w / '__init__.py')}".rstrip())
        else:
            out.append("tpprobe/")
        for p in files:
            rel = p.relative_to(pkg_root / w if w else pkg_root).as_posix()
            if rel == "__init__.py" and w:
                continue
            if rel.endswith("/__init__.py"):
                rel = rel[:-len("__init__.py")]
            out.append(f"{('  ' + rel):<{NAME - 1}} {first_sentence(p)}".rstrip())
    return "\n".join(["```", *out, "```"])


def page_layout(text: str) -> str:
    return readme_section.section(text, BEGIN, END)


if __name__ == "__main__":
    if "--write" in sys.argv:
        readme_section.write(BEGIN, END, section(), PAGE)
    else:
        print(section())
