"""Print tpprobe's import graph (module -> the tpprobe modules it imports), read with ast only.

    python scripts/import_graph.py            # one line per module: its imports (lazy ones marked ~)
    python scripts/import_graph.py --cycles   # only the cycles, counting lazy imports too

Nothing is imported or executed; tests/house/test_house.py checks the same graph in CI.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tpprobe"


# The floors, top to bottom: a module imports only modules of its own wing or of a wing on a
# lower floor, never one beside it or above it. A wing is the longest prefix named here.
# tests/house/test_house.py holds the code to them; scripts/layout.py lists the wings so.
FLOORS = [
    ["cli"],                             # one module per command
    ["invariance"],
    ["probe"],                           # the pipeline every rank runs
    ["dumpdir", "eagle3"],               # SGLang dumper folders; EAGLE-3 diff and accept
    ["report"],                          # the shared Report, its one sink and renderers; sglang_plan builds a section
    ["engines"],                         # the model sources side by side (registry): builtin/, sglang/, vllm/, user
    ["checks", "exchange"],
    ["formats"],                         # capture folders, SpecForge samples
    ["capture"],
    ["fingerprint"],
    ["config"],                          # option fields, knobs, fault names
    ["core", "libs"],                    # the ground floor
]
LEVEL = {wing: i for i, floor in enumerate(FLOORS) for wing in floor}


def wing(mod: str) -> str:
    """The wing a module lives in, the longest prefix FLOORS names: tpprobe.checks.run -> checks,
    tpprobe.config.knobs -> config; "" for the package root,
    ".name" for a module outside every wing."""
    parts = mod.split(".")[1:]
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in LEVEL:
            return ".".join(parts[:k])
    return "." + ".".join(parts) if parts else ""


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_main_guard(node) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Compare) \
        and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"


def imports(mods: dict[str, Path] | None = None):
    """{module: [(imported module, imported names, lazy, line)]} for imports of tpprobe modules.
    `from pkg import sub` counts as an import of pkg.sub when sub is a module."""
    mods = mods or modules()
    graph: dict[str, list] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        top = {id(n) for n in tree.body}
        for n in tree.body:      # imports under `if`/`try` at module level run at import time too
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(x) for x in ast.walk(n)}
        edges = []
        main_block = {id(x) for n in tree.body if _is_main_guard(n) for x in ast.walk(n)}
        for node in ast.walk(tree):
            if id(node) in main_block:   # `if __name__ == "__main__":` runs as a script, never on import
                continue
            lazy = id(node) not in top
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "tpprobe":
                        edges.append((a.name, [], lazy, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node.level, node.module) if node.level else node.module
                if not target or target.split(".")[0] != "tpprobe":
                    continue
                plain = []
                for a in node.names:
                    if f"{target}.{a.name}" in mods:
                        edges.append((f"{target}.{a.name}", [], lazy, node.lineno))
                    else:
                        plain.append(a.name)
                if plain or not node.names:
                    edges.append((target, plain, lazy, node.lineno))
        graph[mod] = edges
    return graph


def cycles(graph) -> list[list[str]]:
    """Every elementary cycle's node list, found by DFS from each module (small graph)."""
    adj = {m: sorted({t for t, _, _, _ in e if t in graph and t != m}) for m, e in graph.items()}
    found, seen = [], set()

    def dfs(start, node, path):
        for nxt in adj.get(node, []):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [start])
            elif nxt not in path and nxt > start:
                dfs(start, nxt, path + [nxt])

    for m in sorted(adj):
        dfs(m, m, [m])
    return found


def main() -> None:
    g = imports()
    if "--cycles" in sys.argv:
        for c in cycles(g):
            print(" -> ".join(c))
        return
    for mod, edges in g.items():
        tgt = sorted({("~" if lazy else "") + t for t, _, lazy, _ in edges if t != mod})
        print(f"{mod}: {', '.join(tgt) if tgt else '-'}")
    c = cycles(g)
    print(f"\n{len(g)} modules, {sum(len(e) for e in g.values())} imports, {len(c)} cycles")


if __name__ == "__main__":
    main()
