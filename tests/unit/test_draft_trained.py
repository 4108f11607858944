"""What a draft was trained on (TPPROBE_DRAFT_TRAINED) and the ids that give it to vLLM: the words of the live
drafter report (tpprobe.engines.vllm.acceptance), with no engine. The engine runs:
tests/engines/vllm/test_vllm_draft_live.py."""
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


# ---- TPPROBE_DRAFT_TRAINED=specforge:PATH: a SpecForge training sample's slots matched to a captured prefill -------
def _streams(T=6, H=16, L=4, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return {h: torch.randn(T, H, generator=g) for h in range(L + 1)}


def _sample(tmp_path, ids, slots, name="data_0.ckpt"):
    import torch
    from tpprobe.formats.specforge import write_sample
    return write_sample(tmp_path / "rows_0-1" / name, torch.tensor(ids), torch.cat(slots, dim=-1))


def test_a_specforge_sample_is_matched_slot_by_slot_on_the_tokens_it_shares_with_a_captured_prefill(tmp_path):
    import torch
    from tpprobe.engines import draft_training as dt
    s = _streams()
    ids = [5, 9, 2, 7, 1, 3]
    # SpecForge wrote hidden_states 1, 2, 3 of 6 tokens in bf16 (another engine, another dtype); the engine served
    # the first 4 tokens (the prompt) and another prompt
    path = _sample(tmp_path, ids, [s[h].to(torch.bfloat16) for h in (1, 2, 3)])
    forwards = [(torch.tensor([8, 8, 8]), {h: v[:3] for h, v in s.items()}, "step 0, request 1"),
                (torch.tensor(ids[:4]), {h: v[:4] for h, v in s.items()}, "step 0, request 0")]
    got, how = trained_slots(f"specforge:{path}", [0, 1, 2], lambda: forwards)
    assert got == [1, 2, 3], how
    assert how.startswith(f"the SpecForge sample {path}: its 3 slots are HF hidden_states [1, 2, 3] (matched to the "
                          f"target's streams at step 0, request 0, 4 shared tokens"), how
    # the SGLang plugin's grammar reads the same text (the match needs a forward's streams: none at parse time)
    t = dt.parse(f"specforge:{path}")
    assert t == {"specforge": str(path), "from": f"TPPROBE_DRAFT_TRAINED=specforge:{path}"}
    assert dt.trained_hidden_states(t, [0, 1, 2]) is None


def test_a_specforge_sample_that_cannot_be_matched_says_why(tmp_path):
    import torch
    s = _streams()
    fw = [(torch.tensor([5, 9, 2]), {h: v[:3] for h, v in s.items()}, "step 0, request 0")]
    # its tokens were never served: what to send
    p = _sample(tmp_path, [4, 4, 4, 4], [s[1][:4], s[2][:4]])
    got, why = trained_slots(f"specforge:{p}", [0, 1], lambda: fw)
    assert got is None and "shares no 2+ leading tokens with a captured prefill: serve its input_ids" in why, why
    # a slot that is no stream of this target (another model's sample, or other weights)
    p = _sample(tmp_path, [5, 9, 2], [s[1][:3], _streams(seed=1)[0][:3]], "data_1.ckpt")   # other weights' stream
    got, why = trained_slots(f"specforge:{p}", [0, 1], lambda: fw)
    assert got is None and f"slot 1 of the SpecForge sample {p} is no stream of the target's forward" in why, why


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("true",))


@pytest.mark.parametrize("case", ["missing", "code", "no-aux"])
def test_a_specforge_sample_tpprobe_cannot_read_is_one_line(tmp_path, case):
    import torch
    p = tmp_path / "data_0.ckpt"
    if case == "code":
        torch.save({"input_ids": torch.tensor([1, 2]), "aux_hidden_state": _Evil()}, str(p))
    elif case == "no-aux":
        torch.save({"input_ids": torch.tensor([1, 2])}, str(p))
    with pytest.raises(UsageError) as e:
        trained_slots(f"specforge:{p}", [0, 1], lambda: [])
    msg = str(e.value)
    assert msg.startswith(f"TPPROBE_DRAFT_TRAINED=specforge:{p}: ") and "\n" not in msg, msg
    assert {"missing": "no such file", "code": "loading it would call", "no-aux": "no 'aux_hidden_state'"}[case] \
        in msg, msg


def test_a_replay_is_read_from_the_longest_prompt_of_a_drafter_file():
    """tpprobe fix's --streams DRAFTER_DIR and the live report's replay pick their prompt by the one rule."""
    from tpprobe.engines.vllm.draft_streams import prompt_rows
    reqs = [{"kind": "prefill", "rows": [0, 5]}, {"kind": "verify", "rows": [5, 7]},
            {"kind": "prefill", "rows": [7, 15]}, {"kind": "prefill", "rows": [15, 23]},
            {"kind": "prefill", "rows": [23, 25]}]
    assert prompt_rows(reqs) == [(7, 15), (15, 23), (0, 5)]
    assert prompt_rows(None) == [] and prompt_rows(reqs, min_rows=9) == []


def _f30(replay: dict) -> dict:
    """The drafter section of an F30 report (a draft trained on HF hidden_states [3, 1, 2] in that order, served
    [1, 2, 3]) as analyse() makes it, with `replay` beside it."""
    from tpprobe.checks.findings import Finding
    from tpprobe.engines.vllm.acceptance import fix_for
    head = "the draft's ids [3, 1, 2] are not in layer order and vLLM sorts them (catalogue F30): ..."
    fix_ids, fix = fix_for([3, 1, 2], 4)
    f = Finding("slot-mismatch", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1], detail=f"{head}; fix: {fix}",
                evidence={"all_ranks": True}).to_json()
    return {"trained": [3, 1, 2], "fix_ids": fix_ids, "fix": fix, "findings": [f], "replay": replay,
            "fix_finding": {"kind": f["kind"], "where": f["where"], "head": head}}


def _score(fp: float) -> dict:
    return {"first_position": fp, "accept_length": 1.0 + 5 * fp, "chain": 5, "per_position": [fp] * 5}


def test_the_finding_says_what_the_replay_found_when_no_id_list_gives_the_training():
    """F30 with a draft that reads one slot: no id list gives the trained order, but the replay finds ids that
    serve the draft. The finding used to say "no id list gives that order" while the replay's line in the same
    report gave ids that serve it; it now says both, in one fix."""
    from tpprobe.engines.vllm.acceptance import replayed_fix
    rp = {"available": True, "where": "step 0 (extend), prompt rows 0..7", "explained": True, "fix_ids": [0, 1, 3],
          "current": {"streams": [1, 2, 3], "score": _score(0.0)},
          "best": {"streams": [0, 1, 3], "score": _score(1.0)},
          "permute_check": {"ids": [1, 2, 3], "streams": [3, 1, 2], "score": _score(1.0), "current": _score(0.0)}}
    a = _f30(rp)
    replayed_fix(a)
    fix = ("no id list reproduces the training order HF hidden_states[3, 1, 2] on vLLM (it fills the slots in "
           "ascending id order); replayed on step 0 (extend), prompt rows 0..7, ids [0, 1, 3] give first-position "
           "acceptance 0.00 -> 1.00 (accept length, chain of 5: 1.00 -> 6.00): set `eagle_aux_hidden_state_layer_ids`"
           " to [0, 1, 3]; or write `eagle_aux_hidden_state_layer_ids` as [1, 2, 3] and permute the column blocks of "
           "the draft's fc.weight to it (take blocks [1, 2, 0] of the trained order; so permuted, the draft replays "
           "first-position acceptance 0.00 -> 1.00 (accept length, chain of 5: 1.00 -> 6.00)), or retrain with the "
           "ids in layer order")
    f = a["findings"][0]
    assert (a["fix"], a["fix_replayed"]) == (fix, True)
    assert (a["fix_ids"], a["fix_ids_from"]) == ([0, 1, 3], "replay")      # the JSON gives the ids the line gives
    assert f["detail"] == ("the draft's ids [3, 1, 2] are not in layer order and vLLM sorts them (catalogue F30): "
                           f"...; fix: {fix}")
    assert f["line"] == f"FAILURE slot-mismatch at drafter slots [0, 1, 2], step 0 (extend) (all ranks): {f['detail']}"
    # no replay: the finding as analyse() wrote it
    b = _f30({"available": False, "why": "no captured prompt"})
    before = dict(b["findings"][0])
    replayed_fix(b)
    assert b["findings"][0] == before and "fix_replayed" not in b and b["fix_ids"] is None
