"""Every TPPROBE_* variable is declared once and documented: the SGLang plugin's in
engines/sglang/options.py PluginOptions, the rest in tpprobe/config/knobs.py; no module reads os.environ for one of them
directly; the tables in docs/configuration.md (a user's) and docs/development.md (diagnosis, tests, internal) are
generated from the declarations (scripts/knobs_table.py)."""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import knobs_table  # noqa: E402

from tpprobe.config.knobs import KNOBS  # noqa: E402
from tpprobe.engines.sglang.options import PluginOptions  # noqa: E402

DECLARED = {f.metadata["env"] for f in fields(PluginOptions)} | set(KNOBS)
READERS = {ROOT / "tpprobe" / "engines" / "sglang" / "options.py", ROOT / "tpprobe" / "config" / "knobs.py"}


def _sources():
    return sorted((ROOT / "tpprobe").rglob("*.py"))


def test_every_tpprobe_variable_named_in_the_code_is_declared():
    named = set()
    for p in _sources():
        named |= {n for n in re.findall(r"\bTPPROBE_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    assert sorted(named - DECLARED) == []


def test_no_module_reads_a_tpprobe_variable_from_the_environment_itself():
    bad = []
    for p in _sources():
        if p in READERS:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            # os.environ.get("TPPROBE_..."), os.environ["TPPROBE_..."], os.getenv("TPPROBE_...")
            args = []
            if isinstance(node, ast.Call) and isinstance(node.func,
                                                         ast.Attribute) and node.func.attr in ("get", "getenv"):
                args = node.args[:1]
            elif isinstance(node, ast.Subscript):
                args = [node.slice]
            for a in args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("TPPROBE_"):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} {a.value}")
    assert bad == []


def test_the_docs_tables_list_every_variable_with_its_default_and_meaning():
    user, dev = knobs_table.USER_PAGE.read_text(), knobs_table.DEV_PAGE.read_text()
    assert knobs_table.page_table(user) == knobs_table.table(), "run: python scripts/knobs_table.py --write"
    assert knobs_table.page_table(dev, dev=True) == knobs_table.table(dev=True), \
        "run: python scripts/knobs_table.py --write"
    assert {n for n, *_ in knobs_table.rows()} == DECLARED
    shown = set(re.findall(r"^\| `(TPPROBE_\w+)`", user + dev, re.M))
    assert shown == DECLARED
