"""`tpprobe layers` for every SGLang architecture: the rule is derived from the installed SGLang's
own `set_eagle3_layers_to_capture` and capture condition (tpprobe.engines.sglang.rules), the names people
use resolve, the exit code says when ids crash or drop, and the draft/target contract (F19) is
read slot by slot from two config.json files. No model is run; the real captures that prove these
rules are in tests/engines/sglang/test_sglang_archs.py and tests/engines/sglang/test_sglang_models.py.

CLI cases are forked from this warm interpreter (sglang imported once), as in test_cli_usage.
"""
from __future__ import annotations

import json

import pytest

from tests.ranks.test_cli_usage import _fork_cli
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]


@pytest.fixture(scope="module")
def rules():
    from tpprobe.engines.sglang import rules as r

    r.all_architectures()      # every SGLang model file imported once: forked CLI cases start warm
    return r


def _derive(rules, name, ids, L):
    from tpprobe.engines.sglang.layer_ids import plan_from_derived

    return plan_from_derived(name, rules.derive(name, ids, L))


def test_every_architecture_is_derived_from_sglang(rules):
    from tpprobe.engines.sglang.layer_ids import plan_from_derived

    archs = rules.all_architectures()
    files = {f for f, _ in archs}
    # every model file of SGLang that defines the setter has an architecture here
    assert files >= set(rules.setter_files()) - {"mindspore"} and len(archs) >= 40
    for f, cls in archs:
        p = plan_from_derived(cls.__name__, rules.derive(cls, None, 8))
        if f == "mindspore":            # delegates to a model outside SGLang: said, not guessed, not a crash
            assert p.crash is None and p.problems == [] and p.rows == []
            assert "hands the ids to self.model.set_eagle3_layers_to_capture" in p.outside
            continue
        assert p.crash is None and p.source.startswith("derived"), (cls, p.crash)
        want = [3, 5, 6] if f == "minimax_m3_vl" else [2, 4, 5]    # m3_vl applies +1 to its default
        assert p.slot_hf_indices == want, (cls, p.slot_hf_indices)


@pytest.mark.parametrize("name,ids,L,ltc,slots,crash", [
    ("llama", [-1, 0, 2], 8, [0, 1, 3], [0, 1, 3], None),                       # +1 always
    ("Qwen3ForCausalLM", [1, 7], 8, [2, 8], [2], None),                        # L-1 dropped
    ("deepseek_v3", [1, 3], 8, [2, 4], [2, 4], None),                          # first id 1: +1
    ("kimi_k2", [0, 3], 8, [0, 3], [0, 3], None),                              # else as given
    ("kimi", [-1, 2], 8, [-1, 2], [2], "captured 1 of 2"),                     # packer raises
    ("qwen3_moe", [1, 7], 8, [2, 8], [], "IndexError"),                        # flags layers[8]
    ("qwen3_moe", [-2, 3], 8, [-1, 4], [4, 7], None),                          # -1 flags the LAST layer
    ("gpt_oss", [2, 5, 8], 8, [2, 5, 8], [2, 5, 8], None),                     # max == L: as given, L captured
    ("gpt_oss", [1, 7], 8, [2, 8], [2, 8], None),                              # +1, L via the final norm
    ("Gemma4ForCausalLM", [7], 8, [8], [8], None),
    ("glm4_moe_lite", [-1, 2], 8, [-1, 2], [2], None),                         # dropped silently
])
def test_rules_as_sglang_applies_them(rules, name, ids, L, ltc, slots, crash):
    p = _derive(rules, name, ids, L)
    assert p.layers_to_capture == ltc and p.slot_hf_indices == slots, (p.layers_to_capture, p.slot_hf_indices)
    assert (crash is None) == (p.crash is None) and (crash is None or crash in p.crash), p.crash


def test_pinned_fallback_agrees_with_the_derived_rule(rules):
    from tpprobe.engines.sglang.layer_ids import pinned_plan

    for arch in ("llama", "deepseek_v2"):
        for ids in (None, [-1, 1, 3], [1, 3, 7], [0, 2, 5], [2, 2], [7], [4, 0]):
            a, b = pinned_plan(arch, ids, 8), _derive(rules, arch, ids, 8)
            assert (a.layers_to_capture, a.slot_hf_indices, bool(a.crash)) == \
                   (b.layers_to_capture, b.slot_hf_indices, bool(b.crash)), (arch, ids)


def test_layers_cli_names_exit_codes_and_contract(rules, tmp_path):
    cli = {
        "ok": ["layers", "--arch", "qwen3", "--ids", "-1,1,3", "--num-layers", "8"],
        "kimi": ["layers", "--arch", "kimi", "--num-layers", "61"],
        "class": ["layers", "--arch", "Qwen3MoeForCausalLM", "--ids", "1,7", "--num-layers", "8"],
        "dropped": ["layers", "--arch", "llama", "--ids", "1,7", "--num-layers", "8"],
        "crash": ["layers", "--arch", "deepseek_v2", "--ids", "-1,2,30", "--num-layers", "61"],
        "unknown": ["layers", "--arch", "gpt9"],
        "outside": ["layers", "--arch", "MindSporeForCausalLM", "--ids", "-1,2,30", "--num-layers", "61"],
        "outside_rule": ["layers", "--arch", "MindSporeForCausalLM", "--ids", "-1,2,30", "--num-layers", "61",
                         "--id-rule", "-1=embed,2=out:2,30=out:30"],
        "all": ["layers", "--arch", "all", "--num-layers", "8"],
    }
    d = tmp_path
    (d / "target.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}))
    (d / "nested.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    (d / "top.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [0, 29, 57]}))
    (d / "before.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 29, 57]}}))
    for k in ("nested", "top", "before"):
        cli[k] = ["layers", "--draft-config", str(d / f"{k}.json"), "--target-config", str(d / "target.json")]
    cli["half"] = ["layers", "--draft-config", str(d / "top.json")]
    res = {k: _fork_cli(a, tmp_path) for k, a in cli.items()}
    text = {k: " ".join(r.stdout.split()) for k, r in res.items()}
    assert res["ok"].returncode == 0 and "layers_to_capture=[0, 2, 4]" in text["ok"]
    assert res["kimi"].returncode == 0 and "deepseek_v2.py" in text["kimi"]
    assert res["class"].returncode == 1 and "IndexError" in text["class"]
    assert res["dropped"].returncode == 1 and "dropped" in text["dropped"]
    assert res["crash"].returncode == 1 and "captured 2 of 3" in text["crash"]
    assert res["unknown"].returncode == 2 and "unknown SGLang arch 'gpt9'" in res["unknown"].stderr
    assert "Traceback" not in res["unknown"].stderr
    # the count it gives is the list `--arch all` prints, one row per architecture
    from tpprobe.engines.sglang.rules_replay import table_rows
    assert f"has EAGLE-3 capture in {len(table_rows())} architectures (`tpprobe layers --arch all` lists them)" \
        in " ".join(res["unknown"].stderr.split())
    # a rule outside SGLang's code: one line, exit 2 (nothing here can say what the ids capture), unless the
    # user gives it for every id; `--arch all` says it did not check that one and exits on the others alone
    out = " ".join(res["outside"].stderr.split())
    assert res["outside"].returncode == 2 and out.startswith("tpprobe: error: MindSporeForCausalLM.set_eagle3_layers_"
                                                             "to_capture (sglang/srt/models/mindspore.py:")
    assert "--id-rule" in out and "crash" not in out and len(res["outside"].stderr.splitlines()) == 1
    assert res["outside_rule"].returncode == 0 and "HF hidden_states[3]" in text["outside_rule"]
    assert res["all"].returncode == 0, text["all"][-2000:]
    assert f"OK: every architecture checked captures one usable slot per id ({len(rules.all_architectures()) - 1} " \
        f"of {len(rules.all_architectures())} architectures; not checked: MindSporeForCausalLM" in text["all"]
    # F19: the contract, slot by slot
    assert res["nested"].returncode == 0 and "agree on every slot" in text["nested"]
    top = text["top"]
    assert res["top"].returncode == 1 and "top level of its config" in top
    assert "slot 0: the draft expects HF hidden_states[1] (layer 0's output), the target captures " \
           "HF hidden_states[2] (layer 1's output)" in top and "capture-offset" in top
    # DeepSeek uses ids whose first is not 1 as given: one layer early for an output-of-k draft
    assert res["before"].returncode == 1 and "one layer early" in text["before"]
    assert res["half"].returncode == 2 and "--draft-config needs --target-config" in res["half"].stderr


def test_contract_json_vocabulary(tmp_path):
    from tpprobe.cli.layers import contract

    (tmp_path / "t.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}))
    (tmp_path / "d.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 31]}}))
    res = contract(tmp_path / "d.json", tmp_path / "t.json")
    # id 31 = L-1 -> layer 32: never reached by Llama's loop; the draft's third slot gets nothing
    assert res["finding"] == "id-contract" and [r["ok"] for r in res["rows"]] == [True, True, False]
    assert res["rows"][2]["target_captures"] == "nothing" and res["verdict"]["kind"] == "missing-capture"
