"""`tpprobe layers` knows every SGLang architecture without SGLang, and is fast
with it.

The rules are SGLang 0.5.23's own code, tabulated as data (tpprobe/engines/sglang/rules_table.py, written by
`python -m tpprobe.engines.sglang.rules --write`). In the SGLang tier the table is regenerated from the
installed SGLang and must equal the shipped file, and replaying it must equal running SGLang's own
setter (`rules.derive`) on ids and depths the generator never saw, for every architecture and name.
Without SGLang (a subprocess whose import path really lacks it) the documented draft/target example
and every architecture answer; with SGLang 0.5.23 installed, `plan` imports no SGLang.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tpprobe.engines.sglang import INSTALL_HINT, available

ROOT = Path(__file__).resolve().parents[3]
sglang_tier = [pytest.mark.sglang, pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]


def _python_without_sglang(tmp_path: Path) -> tuple[list[str], dict]:
    """`python -S` over a copy of site-packages' entries (symlinks) with every sglang* left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site"
    farm.mkdir()
    for e in site.iterdir():
        if not e.name.lower().startswith(("sglang", "__editable__", "tpprobe")) and not e.name.endswith(".pth"):
            (farm / e.name).symlink_to(e)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(farm)])}
    return [sys.executable, "-S"], env


def test_layers_knows_every_architecture_without_sglang(tmp_path):
    py, env = _python_without_sglang(tmp_path)
    check = subprocess.run([*py, "-c", "import importlib.util as u, tpprobe, typer, torch; "
                            "print(u.find_spec('sglang'), tpprobe.__file__)"], capture_output=True, text=True, env=env)
    assert check.stdout.split() == ["None", str(ROOT / "tpprobe" / "__init__.py")], check.stderr[-2000:]

    def layers(*args):
        return subprocess.run([*py, "-m", "tpprobe", "layers", *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=120)

    # the documented draft/target example: a real finding (exit 1), not "unknown SGLang arch"
    p = layers("--draft-config", "examples/eagle3/draft_config.json",
               "--target-config", "examples/eagle3/target_config.json")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "FAILURE id-contract (capture-offset at aux slot 0)" in p.stdout, p.stdout[-2000:]
    assert "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture" in p.stdout.replace("\n", "")
    p = layers("--arch", "all", "--json")
    import json
    rows = json.loads(p.stdout)
    assert len(rows) >= 40 and {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                                "DeepseekV3ForCausalLM"} <= {r["arch"] for r in rows}
    p = layers("--arch", "qwen3_moe", "--ids", "1,47", "--num-layers", "48", "--json")
    d = json.loads(p.stdout)
    assert p.returncode == 1 and "IndexError" in d["crash"] and "tabulated" in d["source"], d
    p = layers("--arch", "nosuch")
    assert p.returncode == 2 and "SGLang 0.5.23 has EAGLE-3 capture in" in p.stderr and "known for" not in p.stderr


def test_plan_imports_no_sglang():
    """With SGLang 0.5.23 installed the table answers: no SGLang import (was 11-22 s for one plan)."""
    code = ("import sys, time; t = time.time(); from tpprobe.engines.sglang.layer_ids import plan; "
            "p = plan('DeepseekV3ForCausalLM', [-1, 2, 30], 61); "
            "print('sglang' in sys.modules, p.layers_to_capture, round(time.time() - t, 2))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    imported, ltc, took = p.stdout.strip().split(" ", 1)[0], p.stdout.split("[")[1].split("]")[0], p.stdout.split()[-1]
    assert imported == "False" and ltc == "-1, 2, 30", p.stdout + p.stderr[-2000:]
    assert float(took) < 5, took


@pytest.fixture(scope="module")
def live():
    from tpprobe.engines.sglang import rules, rules_replay, rules_table

    if rules_replay.installed_version() != rules_table.SGLANG_VERSION:
        pytest.skip(f"the table is SGLang {rules_table.SGLANG_VERSION}'s; the installed SGLang is "
                    f"{rules_replay.installed_version()} (its own code answers there)")
    return rules, rules.tabulate()


@pytest.mark.sglang
@pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")
def test_the_shipped_table_is_the_installed_sglangs(live):
    rules, tab = live
    from tpprobe.engines.sglang.rules_replay import TABLE_MODULE

    shipped = (ROOT / TABLE_MODULE).read_text()
    assert rules.render_table(tab) == shipped, "regenerate: python -m tpprobe.engines.sglang.rules --write"
    assert len(tab["CLASSES"]) >= 45 and len(tab["ARCHITECTURES"]) >= 40


@pytest.mark.sglang
@pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")
def test_the_table_replays_sglangs_setter_on_ids_it_never_saw(live):
    rules, tab = live
    from tpprobe.engines.sglang import rules_replay
    from tpprobe.engines.sglang.layer_ids import plan_from_derived

    grid = [(ids, L) for L in (7, 9, 12, 27, 48, 94)
            for ids in (None, [1, L // 3, L - 2], [0, 5, L], [3, -1], [L - 1, 1], [L + 2], [-L + 1, 0], [2, 2, 4])]
    live = {key: cls for (f, cls), (_, _, key) in zip(rules.all_architectures(), tab["ARCHITECTURES"])}
    for name in tab["CLASSES"]:
        cls = live[name] if "." in name else rules.resolve(name)
        for ids, L in grid:
            a, b = rules_replay.derive_from_table(name, ids, L), rules.derive(cls, ids, L)
            assert rules._fields(a) == rules._fields(b), (name, ids, L)
            pa, pb = plan_from_derived(name, a), plan_from_derived(name, b)
            assert (pa.rule, pa.crash, pa.problems, pa.slot_hf_indices) == (pb.rule, pb.crash, pb.problems,
                                                                          pb.slot_hf_indices)
    names = [*tab["FILES"], *tab["MODEL_TYPES"], *[n for n in rules_replay.ALIASES],
             *[c for c in tab["CLASSES"] if "." not in c]]
    for n in names:     # every name resolves to the class SGLang's own lookup finds
        assert rules_replay.resolve_in_table(n, tab) == rules.resolve(n).__name__, n
