"""SGLang 0.5.23 EAGLE-3 layer-id rules (pure; the same table is proven against real captures
in tests/engines/sglang/test_sglang_models.py)."""
import io
import json

import pytest
from rich.console import Console

from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang.layer_ids import parse_ids, plan
from tpprobe.report.sglang_plan import render_layers_table


def test_llama_plus_one_always():
    p = plan("llama", [-1, 0, 2], 8)
    assert p.shift == 1 and p.layers_to_capture == [0, 1, 3]
    assert [r.hf_index for r in p.rows] == [0, 1, 3]
    assert p.rows[0].what.startswith("embedding output")
    assert "entering layer 3 = layer 2's output = HF hidden_states[3]" in p.rows[2].what
    assert p.crash is None and p.slot_hf_indices == [0, 1, 3]


def test_llama_last_layer_dropped_or_crash():
    p = plan("llama", [1, 7], 8)          # 7 -> 8 = L: never reached
    assert [r.status for r in p.rows] == ["ok", "dropped"] and p.crash is None
    assert p.num_slots == 1
    alone = plan("llama", [7], 8)
    assert alone.rows[0].status == "crash" and "llama.py" in alone.crash


def test_deepseek_plus_one_only_when_first_is_one():
    assert plan("deepseek_v2", [1, 5], 8).layers_to_capture == [2, 6]
    assert plan("deepseek_v3", [2, 5], 8).layers_to_capture == [2, 5]
    assert plan("kimi_k2", [5, 1], 8).layers_to_capture == [5, 1]
    p = plan("deepseek_v2", [0, 3], 8)
    assert p.rows[0].what.startswith("embedding output") and p.shift == 0


def test_deepseek_out_of_range_crashes_packer():
    p = plan("deepseek_v2", [-1, 2, 30], 61)   # the example: -1 is not the embedding here
    assert [r.status for r in p.rows] == ["crash", "ok", "ok"]
    assert "captured 2 of 3" in p.crash
    assert "captured 1 of 2" in plan("deepseek_v2", [2, 2], 8).crash   # duplicate


def test_default_ids_and_order():
    p = plan("llama", None, 8)
    assert p.layers_to_capture == [2, 4, 5] and p.shift == 0
    q = plan("llama", [4, 0], 8)
    assert [r.slot for r in q.rows] == [1, 0]
    assert "layer order" in q.rows[0].note


def test_render_and_errors():
    buf = io.StringIO()
    render_layers_table("deepseek_v2", [-1, 2, 30], 61, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "crash" in out and "hidden_states[30]" in out
    with pytest.raises(UsageError):
        plan("gpt2", [1], 4)
    with pytest.raises(UsageError):
        parse_ids("1,x")
    assert parse_ids("-1, 2,30") == [-1, 2, 30] and parse_ids(None) is None


def _layers(capsys, *args) -> tuple[int, str]:
    from tpprobe.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["layers", *map(str, args)])
    return e.value.code, " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("arch, engine, status", [("llama", "sglang", "duplicate"),
                                                  ("deepseek_v3", "vllm", "duplicate"),
                                                  ("deepseek_v3", "sglang", "crash")])
def test_colliding_default_ids_are_named_with_their_slot_never_none(capsys, arch, engine, status):
    # no --ids: the model's default ids [2, L//2, L-3] are [2, 2, 1] on 4 layers, id 2 twice: the problem names the
    # id and the slot that holds its stream, never `id None`
    code, out = _layers(capsys, "--arch", arch, "--num-layers", 4, "--engine", engine)
    said = (f"PROBLEM: default id 2 (ids not given: the model's default ids [2, 2, 1]): {status}, its stream captured "
            f"once, in aux slot 1")
    assert code == 1 and said in out and "None" not in out, out
    code, out = _layers(capsys, "--arch", arch, "--num-layers", 4, "--engine", engine, "--json")
    assert json.loads(out)["problems"] == [said.removeprefix("PROBLEM: ")]


def test_a_draft_without_ids_on_a_shallow_target_never_says_none(capsys, tmp_path):
    # the contract of a draft with no ids (the default capture) against a 4-layer DeepSeek-V3: the engines' notes
    # and the slot verdict name the default ids, or no id, never `None`
    draft, target = tmp_path / "draft.json", tmp_path / "target.json"
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                                 "draft_vocab_size": 100}))
    target.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4,
                                  "model_type": "deepseek_v3"}))
    code, out = _layers(capsys, "--draft-config", draft, "--target-config", target, "--engine", "vllm")
    assert code == 1 and "None" not in out, out
    assert "note: vLLM: default id 2 (ids not given: the model's default ids [2, 2, 1]): duplicate, its stream " \
           "captured once, in aux slot 1" in out, out
    assert "slot 0 equals layer 0's output, expected layer 1's output: one layer early" in out, out
    assert "SGLang ids not given (no eagle_config.eagle_aux_hidden_state_layer_ids" in out, out
