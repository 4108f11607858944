"""What a draft was trained on (TPPROBE_DRAFT_TRAINED) and the ids that give it to vLLM: the words of the live
drafter report (tpprobe.engines.vllm.acceptance), with no engine. The engine runs: tests/test_vllm_draft_live.py."""
from __future__ import annotations

import pytest

from tpprobe.core.errors import UsageError
from tpprobe.engines.vllm.acceptance import fix_for, rates, trained_slots


def test_trained_slots_read_every_way_the_user_says_it():
    assert trained_slots("ids:1,2,3", [0, 1, 2])[0] == [1, 2, 3]
    assert trained_slots("4,1,2", [0, 1, 2])[0] == [4, 1, 2]
    assert trained_slots("convention:output", [0, 1, 2])[0] == [1, 2, 3]           # SpecForge: id k = hs[k+1]
    assert trained_slots("convention:before", [3, 1, 2])[0] == [3, 1, 2]           # written order kept
    assert trained_slots("convention:vllm", [3, 1, 2, 2])[0] == [1, 2, 3]          # vLLM: sorted, de-duplicated
    assert trained_slots(None, [1, 2, 3]) == (None, "not given (TPPROBE_DRAFT_TRAINED)")


@pytest.mark.parametrize("bad", ["convention:eagle", "ids:a,b", "sample:/x.ckpt"])
def test_a_spec_tpprobe_cannot_read_is_one_clear_line(bad):
    with pytest.raises(UsageError, match="TPPROBE_DRAFT_TRAINED=.*(conventions are|ids:A,B,C)"):
        trained_slots(bad, [1, 2, 3])


def test_fix_is_the_ids_when_vllm_can_give_them_else_what_to_do():
    assert fix_for([1, 2, 3], 4) == ([1, 2, 3], "set `eagle_aux_hidden_state_layer_ids` to [1, 2, 3]")
    ids, why = fix_for([3, 1, 2], 4)                       # F30: vLLM sorts, no id list keeps this order
    assert ids is None and "no id list gives that order" in why and "take blocks [1, 2, 0]" in why
    ids, why = fix_for([2, 5], 4)                          # past the last layer's output
    assert ids is None and "no id list gives HF hidden_states[5] on vLLM" in why
    assert fix_for([2, 2], 4)[0] is None


def test_rates_are_vllms_definitions():
    r = rates({"drafts": 10, "draft_tokens": 30, "accepted": 15, "accepted_per_pos": [8, 5, 2]})
    assert (r["rate"], r["mean_acceptance_length"], r["rate_per_pos"]) == (0.5, 2.5, [0.8, 0.5, 0.2])
    assert rates({"drafts": 0, "draft_tokens": 0, "accepted": 0})["rate"] is None
