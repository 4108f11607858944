"""SGLang 0.5.23 EAGLE-3 layer-id rules (pure; the same table is proven against real captures
in tests/engines/sglang/test_sglang_models.py)."""
import io

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
