"""What a draft was trained on, as TPPROBE_DRAFT_TRAINED says it (the vLLM side's grammar), and the ids that give
it on SGLang by SGLang's own rule (the tabulated 0.5.23 setters: no engine needed): bad text is one clear line."""
import pytest

from tpprobe.core.errors import UsageError
from tpprobe.engines import draft_training as dt
from tpprobe.engines.sglang import layer_ids as lid


def test_the_forms_of_tpprobe_draft_trained():
    assert dt.parse("ids:0,2,3")["hidden_states"] == [0, 2, 3]
    assert dt.parse("1,2") == {"hidden_states": [1, 2], "from": "TPPROBE_DRAFT_TRAINED=1,2"}
    assert dt.parse("") is None and dt.from_env({}) is None
    ids = [2, 0, 5]
    assert dt.trained_hidden_states(dt.parse("convention:output"), ids) == [3, 1, 6]
    assert dt.trained_hidden_states(dt.parse("convention:before"), ids) == [2, 0, 5]
    assert dt.trained_hidden_states(dt.parse("convention:vllm"), ids) == [0, 2, 5]
    assert dt.trained_hidden_states(None, ids) is None


@pytest.mark.parametrize("bad, says", [("ids:a,b", "ids:A,B,C takes integers"), ("ids:-1", ">= 0"),
                                       ("convention:sglang", "conventions are output, before, vllm"),
                                       ("layers:1", "give ids:A,B,C")])
def test_bad_text_is_one_line(bad, says):
    with pytest.raises(UsageError) as e:
        dt.parse(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


def _slots_for(arch, L):
    def slots(ids):
        p = lid.plan(arch, ids, L)
        return None if p.crash else p.slot_hf_indices
    return slots


def test_the_fix_is_found_by_the_engines_rule():
    # Llama adds 1 to every id: the embedding is id -1
    assert dt.propose_ids([0, 1, 2], _slots_for("llama", 4), 4)[0] == [-1, 0, 1]
    # DeepSeek uses ids as given unless the first is 1
    assert dt.propose_ids([0, 1, 2], _slots_for("deepseek_v3", 4), 4)[0] == [0, 1, 2]
    # a training order SGLang cannot give: slots follow layer order
    ids, why = dt.propose_ids([3, 1], _slots_for("llama", 4), 4)
    assert ids is None and "fills the slots in layer order" in why
