"""Docs that cannot drift: every guarantee in docs/guarantees.md names tests that exist, every test
file the code and the docs cite exists, and every link between the pages leads somewhere.

Static (ast over tests/, nothing run). A guarantee row must name at least one test function in
full (`test_x`, `tests/file.py::test_x`, `tests/file.py::test_x[param]`); every name it gives in
backticks that looks like a test or a test helper must be defined in tests/ (in the file named,
when one is); a parametrized id must be one the file spells out; a row that says "xfail" must
name a test that is one. docs/faults.md's table is checked against real runs in
tests/ranks/test_faults.py (the last test there); the commands the pages show, in tests/house/test_readme.py.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARANTEES = ROOT / "docs" / "guarantees.md"


def _defs() -> dict[str, dict[str, str]]:
    """{tests/file.py: {function name: its source}} for every function in tests/ (nested ones too)."""
    out = {}
    for p in sorted((ROOT / "tests").rglob("*.py")):
        src = p.read_text()
        out[str(p.relative_to(ROOT))] = {n.name: ast.get_source_segment(src, n) or ""
                                         for n in ast.walk(ast.parse(src))
                                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def _rows() -> list[tuple[str, str]]:
    """(the guarantee, its proof column) for every row of the table."""
    rows = []
    for line in GUARANTEES.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0] not in ("Guarantee",) and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[-1]))
    return rows


REF = re.compile(r"^(?:(?P<file>(?:tests/)?[\w/]+\.py)(?:::)?)?(?P<name>(?:test|assert)_\w+)?"
                 r"(?:\[(?P<param>[^\]]+)\])?$")


def test_the_guarantees_table_has_rows():
    assert len(_rows()) >= 10


def test_every_guarantee_names_tests_that_exist():
    defs = _defs()
    problems = []
    for guarantee, proof in _rows():
        named_tests = []
        for span in re.findall(r"`([^`]+)`", proof):
            if "…" in span:
                problems.append(f"{guarantee[:50]}: `{span}` names no test (write it in full)")
                continue
            m = REF.match(span)
            if not m or not (m.group("file") or m.group("name")):
                continue
            file = m.group("file")
            if file and not file.startswith("tests/"):
                file = "tests/" + file
            if file and file not in defs:
                problems.append(f"{guarantee[:50]}: {file} does not exist")
                continue
            name = m.group("name")
            if not name:
                continue
            where = [f for f in ([file] if file else defs) if name in defs[f]]
            if not where:
                problems.append(f"{guarantee[:50]}: {name} is not defined in {file or 'tests/'}")
                continue
            if m.group("param") and not any(repr(m.group("param"))[1:-1] in (ROOT / f).read_text() for f in where):
                problems.append(f"{guarantee[:50]}: {name}[{m.group('param')}] is not a parameter id there")
            if name.startswith("test_"):
                named_tests += [defs[f][name] for f in where]
        if not named_tests:
            problems.append(f"{guarantee[:50]}: names no test")
        elif "xfail" in guarantee + proof and not any("xfail" in src for src in named_tests):
            problems.append(f"{guarantee[:50]}: says xfail, but none of its tests is one")
    assert problems == []


def test_every_test_file_the_code_and_docs_cite_exists():
    """A module docstring or a doc citing tests/unit/test_x.py (as layer_ids.py once cited a file that was
    never there) must point at a file that exists."""
    texts = [*(ROOT / "tpprobe").rglob("*.py"), *_pages()]
    cited = {(str(p.relative_to(ROOT)), m) for p in texts
             for m in re.findall(r"tests/[\w/]+\.py", p.read_text())}
    assert cited, "the scan finds citations"
    assert sorted((f, m) for f, m in cited if not (ROOT / m).is_file()) == []


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "tests" / "README.md", *(ROOT / "docs").rglob("*.md"),
            *(ROOT / "examples").glob("*.md"), *(ROOT / "bench").glob("*.md")]


# pages other branches add (the lead merges them): linked from the README already
PAGES_BEING_ADDED: set[str] = set()


def test_every_link_between_the_pages_leads_to_a_file_and_heading_that_exist():
    bad = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target, anchor in re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([\w-]+))?\)", text):
            path = (page.parent / target).resolve() if target else page
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if not path.exists():
                if rel not in PAGES_BEING_ADDED:
                    bad.append(f"{page.relative_to(ROOT)}: {target} does not exist")
                continue
            if anchor and path.suffix == ".md":
                heads = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
                if anchor not in heads:
                    bad.append(f"{page.relative_to(ROOT)}: {target}#{anchor}: no such heading")
    assert bad == []


def test_the_sglang_pages_name_every_arch_the_probe_builds_under_its_model_type_names():
    """`--engine sglang --arch` takes its five archs and the model_type names SGLang serves them under
    (deepseek_v3, kimi_k2: Kimi-K2.5's text model); the pages that list the archs name them all."""
    from tpprobe.engines.sglang.tiny_archs import ARCH_ALIASES, ARCHES

    names = [*ARCHES, *(a for a in ARCH_ALIASES if "_" in a)]
    assert {"deepseek_v3", "kimi_k2"} <= set(names)
    for page in ("docs/sglang.md", "docs/commands.md"):
        text = (ROOT / page).read_text()
        assert [n for n in names if not re.search(rf"(?<!\w){n}(?!\w)", text)] == [], page
