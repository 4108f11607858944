"""The model source has one seam: tpprobe.engines.registry.

- no module outside tpprobe/engines/ tests an engine's name as a string (`== "sglang"`, `in ("sglang",
  "vllm")`, `.startswith("vllm")`): it asks the engine (tpprobe.engines.engine.Engine) instead;
- the import graph points down with FLOORS as plain wings (no module given a floor of its own) and the
  option declarations (config/) import no engine;
- `--engine` names the model source, `--backend` the communication backend; `--backend sglang|vllm`, the
  old spelling, still runs as `--engine` and says so in one warning line.
Torch-free and quick: nothing here starts a rank.
"""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tpprobe"
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules.setdefault("import_graph", import_graph)
spec.loader.exec_module(import_graph)

NAMES = ("builtin", "sglang", "vllm")


def _names_in(node) -> list[str]:
    """The engine names a compared value spells: a string, or a tuple/list/set of them (prefixes too)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        v = node.value.rstrip(".:")
        return [v] if v in NAMES else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _names_in(e)]
    return []


def engine_name_tests(path: Path) -> list[str]:
    """Every comparison of a value with an engine's name in one file: ==, !=, in, not in, startswith."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            names = [n for part in (node.left, *node.comparators) for n in _names_in(part)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith"):
            names = [n for a in node.args for n in _names_in(a)]
        elif isinstance(node, ast.match_case):
            names = [n for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue) for n in _names_in(p.value)]
        else:
            continue
        if names:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            out.append(f"{where}:{node.lineno} tests {', '.join(sorted(set(names)))}")
    return out


def test_no_engine_name_is_tested_as_a_string_outside_the_engines():
    bad = [hit for p in sorted(PKG.rglob("*.py")) if "engines" not in p.relative_to(PKG).parts[:1]
           for hit in engine_name_tests(p)]
    assert bad == [], "ask tpprobe.engines.registry instead:\n" + "\n".join(bad)


def test_the_name_test_finds_what_it_looks_for(tmp_path):
    p = tmp_path / "names.py"
    p.write_text('a = b == "sglang"\nc = d in ("x", "vllm")\ne = f.startswith("vllm.")\ng = h == "gloo"\n')
    assert [x.split(" ", 1)[1] for x in engine_name_tests(p)] == ["tests sglang", "tests vllm", "tests vllm"]


def test_floors_are_plain_wings_and_the_graph_points_down():
    floors = [w for floor in import_graph.FLOORS for w in floor]
    assert all("." not in w for w in floors), f"a module given a floor of its own: {floors}"
    wings = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert set(floors) == wings, f"FLOORS names {sorted(set(floors) ^ wings)} that are not exactly the wings"
    graph = import_graph.imports()
    up = [f"{m}:{line} -> {t}" for m, edges in graph.items() for t, _, _, line in edges
          if import_graph.wing(t) in import_graph.LEVEL and import_graph.wing(m) in import_graph.LEVEL
          and import_graph.wing(t) != import_graph.wing(m)
          and import_graph.LEVEL[import_graph.wing(t)] <= import_graph.LEVEL[import_graph.wing(m)]]
    assert up == []
    assert import_graph.cycles(graph) == []
    config_to_engines = [f"{m} -> {t}" for m, edges in graph.items() if m.startswith("tpprobe.config")
                         for t, _, _, _ in edges if t.startswith("tpprobe.engines")]
    assert config_to_engines == []


def test_the_registry_lists_every_engine_the_option_names_and_every_fault_has_a_maker():
    from tpprobe.config.fault_names import FAULTS
    from tpprobe.config.options import ENGINE_NAMES
    from tpprobe.engines.registry import ENGINES, SERVING, USER

    assert tuple(ENGINES) == ENGINE_NAMES
    assert [e.name for e in SERVING] == ["sglang", "vllm"] and not USER.faults
    made = {n for e in ENGINES.values() for n in e.faults}
    assert made == set(FAULTS)
    for e in ENGINES.values():
        assert set(e.faults) <= set(FAULTS) and set(e.fault_aliases.values()) <= set(e.faults), e


def test_the_engine_is_the_model_source_and_backend_the_communication_backend():
    from tpprobe.probe.prepare import options_from_cli

    o = options_from_cli(engine="sglang", backend="gloo")
    assert (o.engine, o.backend, o.engine_from_backend) == ("sglang", "gloo", None)
    argv = o.to_argv()
    assert argv[argv.index("--engine") + 1] == "sglang" and argv[argv.index("--backend") + 1] == "gloo"
    assert "--hidden" not in argv          # the built-in model's shapes stay with the built-in model
    o = options_from_cli()
    assert (o.engine, o.backend, o.layers) == ("builtin", "auto", [-1, 1, 3])


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_the_old_backend_spelling_is_the_engine_with_one_warning(name):
    from tpprobe.config.options import deprecation_line
    from tpprobe.core.errors import UsageError
    from tpprobe.probe.prepare import options_from_cli

    o = options_from_cli(backend=name)
    assert (o.engine, o.backend, o.engine_from_backend) == (name, "auto", name)
    assert o.to_argv()[o.to_argv().index("--backend") + 1] == "auto"      # the ranks get the new spelling
    assert deprecation_line(o.engine_from_backend) == (
        f"tpprobe: warning: --backend {name} is deprecated: use --engine {name} (--backend names the communication "
        f"backend: auto, gloo or nccl)")
    other = "vllm" if name == "sglang" else "sglang"
    with pytest.raises(UsageError, match=f"--backend {name} is the old spelling of --engine {name}, and --engine "
                                         f"says {other}"):
        options_from_cli(backend=name, engine=other)
    # the command line: the warning once, then what the run says (here: a bad --nproc, before any engine loads)
    cp = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--backend", name, "--nproc", "0"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 2
    assert cp.stderr.splitlines() == [deprecation_line(name), "tpprobe: error: --nproc must be >= 1 (got 0)"]


def test_invariance_asks_the_engine_whether_it_builds_it():
    from tpprobe.config.options import typer_parameters
    from tpprobe.core.errors import UsageError
    from tpprobe.invariance.options import InvarianceOptions, validate

    def parsed(**kw):        # as the command line gives them: every option, at its default unless said
        return InvarianceOptions.from_cli(**{**{n: d for n, _, d, _, _ in typer_parameters(InvarianceOptions)},
                                             "tp": "1,2", "batch": "1,3", **kw})

    opts = parsed(engine="vllm")
    with pytest.raises(UsageError, match="tpprobe invariance builds the built-in model, SGLang's"):
        validate(opts)
    old = parsed(backend="sglang")
    assert (old.probe.engine, old.probe.backend, old.engine_from_backend) == ("sglang", "auto", "sglang")
    argv = old.to_argv(2, "/tmp/x")
    assert argv[argv.index("--engine") + 1] == "sglang" and argv[argv.index("--backend") + 1] == "auto"
