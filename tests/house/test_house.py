"""The house plan holds: the package's import graph, read with ast (nothing imported).

- no import cycles, lazy (function-level) imports included: a cycle held apart by a lazy import
  is still a cycle;
- no module imports another module's private (`_name`) names, or reaches them as `mod._name`;
  a private module (`_name.py`) is imported only from its own package;
- the renderers (terminal, html, markdown) never import each other, and the report model imports
  no renderer; they import only report.model and report.labels of tpprobe (and the standard library,
  rich, matplotlib/numpy for the images), and labels imports nothing of tpprobe: renderers lay sections
  out and compute nothing about a run;
- dependencies point one way, floor by floor (`import_graph.FLOORS`): a module imports only its own
  wing and the wings on floors below; the package root holds only __init__ and __main__;
- ruff finds nothing and no Python line is over 120 columns;
- no hand-written module is over 500 lines (the generated rule tables are named as exempt).
Start at scripts/import_graph.py, which builds the graph these tests read.
"""
import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = import_graph
spec.loader.exec_module(import_graph)

MODS = import_graph.modules()
GRAPH = import_graph.imports(MODS)
RENDERERS = {"tpprobe.report.terminal", "tpprobe.report.html", "tpprobe.report.markdown"}


_room = import_graph.wing
LEVEL = import_graph.LEVEL


def test_the_import_graph_has_no_cycles_lazy_imports_included():
    assert import_graph.cycles(GRAPH) == []


def test_no_module_imports_another_modules_private_names():
    bad = []
    for mod, edges in GRAPH.items():
        for target, names, _, line in edges:
            if target == mod:
                continue
            bad += [f"{mod}:{line} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
            leaf = target.rsplit(".", 1)[-1]
            if leaf.startswith("_") and not leaf.startswith("__") \
                    and target.rsplit(".", 1)[0] != mod.rsplit(".", 1)[0]:
                bad.append(f"{mod}:{line} imports the private module {target} from outside its package")
    # `import x as F; F._name` reaches a private name just the same
    for mod, path in MODS.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level or isinstance(node, ast.ImportFrom) \
                    and (node.module or "").startswith("tpprobe"):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tpprobe") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{mod}:{node.lineno} reaches {node.value.id}.{node.attr}")
    assert bad == []


def test_renderers_never_import_each_other_and_the_model_imports_none():
    bad = [f"{m} -> {t}" for m in RENDERERS | {"tpprobe.report.model", "tpprobe.report.labels"}
           for t, _, _, _ in GRAPH[m] if t in RENDERERS and t != m]
    assert bad == []


# of tpprobe a renderer reads the sections and the words and styles of the levels, nothing else; of the rest
# the standard library and its drawing libraries
RENDERER_READS = {"tpprobe.report.model", "tpprobe.report.labels"}
DRAWING = {"rich", "matplotlib", "numpy"}


def test_renderers_import_only_the_report_model_and_the_labels():
    bad = [f"{m} -> {t}" for m in RENDERERS for t, _, _, _ in GRAPH[m] if t not in RENDERER_READS]
    bad += [f"tpprobe.report.labels -> {t}" for t, _, _, _ in GRAPH["tpprobe.report.labels"]]
    for m in sorted(RENDERERS | {"tpprobe.report.labels"}):
        for node in ast.walk(ast.parse(MODS[m].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            bad += [f"{m} -> {n}" for n in names if n.split(".")[0] not in sys.stdlib_module_names | DRAWING]
    assert bad == []


# eagle3/diff/ by concern, in order: each module imports only those before it; the renderer none of them
# (the command, `tpprobe diff`, is cli/diff.py)
DIFF_ORDER = ["load", "tokens", "compare", "match", "render"]


def test_the_diff_package_points_one_way_and_its_renderer_reads_only_the_report():
    pkg = "tpprobe.eagle3.diff"
    assert sorted(m for m in MODS if m.startswith(pkg + ".")) == sorted(f"{pkg}.{m}" for m in DIFF_ORDER)
    bad = []
    for i, m in enumerate(DIFF_ORDER):
        allowed = set() if m == "render" else {f"{pkg}.{x}" for x in DIFF_ORDER[:i]}
        bad += [f"{m} -> {t}" for t, _, _, _ in GRAPH[f"{pkg}.{m}"]
                if (t == pkg or t.startswith(pkg + ".")) and t not in allowed]
    assert bad == []


# invariance/ by concern, in order: each module imports only those before it (the renderer only the
# shared words), and it reads the probe's pieces, never the other way round
INVARIANCE_ORDER = ["options", "levels", "verdict", "compare", "keep", "render", "rank", "run"]


def test_the_invariance_package_points_one_way():
    pkg = "tpprobe.invariance"
    assert sorted(m for m in MODS if m.startswith(pkg + ".")) == sorted(f"{pkg}.{m}" for m in INVARIANCE_ORDER)
    bad = []
    for i, m in enumerate(INVARIANCE_ORDER):
        allowed = {f"{pkg}.levels"} if m == "render" else {f"{pkg}.{x}" for x in INVARIANCE_ORDER[:i]}
        bad += [f"{m} -> {t}" for t, _, _, _ in GRAPH[f"{pkg}.{m}"]
                if (t == pkg or t.startswith(pkg + ".")) and t not in allowed]
    assert bad == []


def test_invariance_reads_collectives_from_the_audit_only():
    """No second collective recorder: nothing in invariance/ patches torch.distributed, hooks every
    module or reads the Tap's private attributes."""
    bad = []
    for mod, path in MODS.items():
        if not mod.startswith("tpprobe.invariance"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                bad.append(f"{mod}:{node.lineno} setattr")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                bad.append(f"{mod}:{node.lineno} reaches {ast.unparse(node)}")
            if isinstance(node, ast.Attribute) and "module_forward" in node.attr:      # global module hooks
                bad.append(f"{mod}:{node.lineno} {node.attr}")
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) \
                    and getattr(node.iter.func, "attr", "") in ("modules", "named_modules") \
                    and any(getattr(getattr(n, "func", None), "attr", "").startswith("register_forward")
                            for n in ast.walk(node)):
                bad.append(f"{mod}:{node.lineno} hooks every module")
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                                    and t.value.id in ("dist", "c10d", "torch") for t in node.targets):
                bad.append(f"{mod}:{node.lineno} assigns into {ast.unparse(node.targets[0])}")
    assert bad == []


def test_every_module_lives_in_a_wing_and_the_root_holds_only_init_and_main():
    assert sorted(p.name for p in (ROOT / "tpprobe").glob("*.py")) == ["__init__.py", "__main__.py"]
    assert sorted(m for m in MODS if _room(m).startswith(".") or _room(m) == "") == ["tpprobe", "tpprobe.__main__"]


def test_dependencies_point_one_way_floor_by_floor():
    """Down only. The root (`tpprobe`) imports nothing at import time (its public names load on first
    use) and is read only for `__version__`; `__main__` runs the command line."""
    bad = []
    for mod, edges in GRAPH.items():
        room = _room(mod)
        for target, names, lazy, line in edges:
            troom = _room(target)
            if troom == room or (target == "tpprobe" and set(names) == {"__version__"}) \
                    or (mod == "tpprobe.__main__" and troom == "cli"):
                continue
            if room not in LEVEL or troom not in LEVEL or LEVEL[troom] <= LEVEL[room]:
                bad.append(f"{mod}:{line} -> {target}{' (lazy)' if lazy else ''}")
    assert bad == []


def test_the_plugin_entry_point_is_the_engines_register():
    """pyproject's entry point is the engine's plugin (tpprobe was never released with another path)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]\ntpprobe = "tpprobe.engines.sglang.plugin:register"\n' in text
    from tpprobe.engines.sglang.plugin import register
    assert callable(register)


def test_importing_tpprobe_or_its_cli_loads_no_torch():
    """`tpprobe --help` and `tpprobe layers` start fast: torch loads only for the commands that use it."""
    import subprocess
    code = "import sys, tpprobe, tpprobe.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_ruff_finds_nothing_and_no_python_line_is_over_120_columns():
    """`ruff check` with pyproject's [tool.ruff]; ruff skips a line that is one long word,
    so the 120 columns are counted here too."""
    import subprocess
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    long = [f"{p.relative_to(ROOT)}:{i}" for top in ("tpprobe", "tests", "scripts", "examples", "bench")
            for p in sorted((ROOT / top).rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert long == []


# generated data, exempt from the size rule: each file -> the command that writes it (its header names it)
GENERATED = {"tpprobe/engines/sglang/rules_table.py": "python -m tpprobe.engines.sglang.rules --write",
             "tpprobe/engines/vllm/rules_table.py": "python -m tpprobe.engines.vllm.rules --write"}
MAX_MODULE_LINES = 500


def test_no_hand_written_module_is_over_500_lines():
    """A module over ~500 lines holds more than one concern: split it by concern. The
    generated tables are exempt, and each says in its docstring that it is generated, and by what."""
    for path, command in GENERATED.items():
        head = (ROOT / path).read_text(encoding="utf-8")[:400]
        assert "GENERATED" in head and command in head, path
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "tpprobe").rglob("*.py"))
           if str(p.relative_to(ROOT)) not in GENERATED
           and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert big == []


def test_the_documented_layout_is_the_tree():
    """docs/architecture.md's Layout section is scripts/layout.py's output: every wing and module,
    each with its docstring's first sentence; a module added or moved without `--write` fails here."""
    spec = importlib.util.spec_from_file_location("layout", ROOT / "scripts" / "layout.py")
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    assert layout.page_layout(layout.PAGE.read_text()) == layout.section(), \
        "run: python scripts/layout.py --write"
    assert all(import_graph.modules()[m].read_text().lstrip().startswith(('"""', 'r"""'))
               for m in import_graph.modules()), "every module opens with a docstring"


def test_every_tpprobe_import_names_a_module_and_a_name_that_exist():
    """Each `from tpprobe... import n` and `from .x import n`, lazy ones inside functions included, resolves:
    a move that missed a function-level import (`from .engines.vllm.faults import ...` left one dot short)
    fails here, not on the first user who takes that path."""
    import importlib
    bad = []
    for path in sorted((ROOT / "tpprobe").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        base = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                mod = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else (node.module or "")
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mod, names = None, [a.name for a in node.names]
            else:
                continue
            if mod is None:
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.startswith("tpprobe") and importlib.util.find_spec(n) is None]
                continue
            if not mod.startswith("tpprobe"):
                continue
            if importlib.util.find_spec(mod) is None:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {mod}")
                continue
            module = importlib.import_module(mod)
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {mod}.{n}" for n in names
                    if n != "*" and not hasattr(module, n) and importlib.util.find_spec(f"{mod}.{n}") is None]
    assert bad == [], bad
