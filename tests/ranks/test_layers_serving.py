"""`tpprobe layers --draft-config D --target-config T` before serving: ids out of layer order (F30), an id
beyond the last layer (F31), per engine and per vLLM model runner; a patched build described once
(`--id-rule`, `TPPROBE_ID_RULE`); what every id captures when one crashes; the ids to write.

The seed's case: a Kimi-K2.5-like target (DeepSeek-V3 text model, 61 layers, nested `text_config`)
and a draft whose config says [-1, 2, 30], trained on cat([embedding, hidden_states[3],
hidden_states[31]]) — on SGLang 0.5.23 as shipped, and on a build patched so that id -1 is the
embedding output.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers.ranks import run_cli
from tpprobe.cli.layers import contract
from tpprobe.engines.before_serving import findings
from tpprobe.engines.capture_rule import parse_id_rule, plan_for
from tpprobe.core.errors import UsageError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256}
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 61,
                        "hidden_size": 7168}}
SEED = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
        "target_hidden_size": 7168, "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 2, 30], "use_aux_hidden_state": True}}


def _write(tmp_path, name, cfg):
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(cfg))
    return p


def test_ids_out_of_layer_order_name_the_slots_that_move_on_vllm():
    f = findings({"eagle_aux_hidden_state_layer_ids": [4, 1, 2]}, "LlamaForCausalLM", 4, 256)
    assert [(x["engine"], x["fault"]) for x in f] == [("vllm", "F30")]
    assert f[0]["line"] == (
        "vLLM (v1 and v2 model runners): ids [4, 1, 2] (eagle_aux_hidden_state_layer_ids) are not in layer order: the "
        "engine fills the slots in ascending layer order, so slot 0 holds id 1's capture (HF hidden_states[1]) "
        "instead of id 4's (HF hidden_states[4]); slot 1 holds id 2's capture (HF hidden_states[2]) instead of id 1's "
        "(HF hidden_states[1]); slot 2 holds id 4's capture (HF hidden_states[4]) instead of id 2's (HF "
        "hidden_states[2]); a draft trained with the slots in the written order accepts almost nothing, with no error "
        "— write [1, 2, 4] and permute the draft's fc.weight column blocks the same way (or just [1, 2, 4] if it was "
        "trained in layer order)")


def test_an_id_beyond_the_last_layer_says_the_engine_dies_at_its_first_draft_step():
    f = findings({"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}, "LlamaForCausalLM", 4, 256)
    assert [x["line"] for x in f] == [
        "vLLM (v1 and v2 model runners): id 5 (eagle_aux_hidden_state_layer_ids) is beyond the last layer of this "
        "4-layer target: vLLM's ids go up to 4 (the last layer's output): it drops id 5 at load without a word, and "
        "the engine starts and dies at its first draft step in the draft's fc (shape '[-1, 768]' is invalid: the "
        "packed aux is one slot short)"]
    assert findings({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, "LlamaForCausalLM", 4, 256) == []


def test_each_engine_and_vllm_runner_reads_its_own_ids():
    """Nested ids only: SGLang and vLLM's v1 runner read them, v2 does not (it takes the model's default)."""
    f = findings({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 62]}}, "DeepseekV3ForCausalLM", 61,
                 7168)
    assert [(x["who"], x["fault"]) for x in f] == [("SGLang", "F31"), ("vLLM (v1 model runner, CPU)", "F31")]
    assert f[0]["line"] == (
        "SGLang: id 62 (eagle_config.eagle_aux_hidden_state_layer_ids) points past the last layer SGLang's loop "
        "reaches on this 61-layer target: SGLang's loop (layers 0..60) never reaches layer 62: the engine starts and "
        "dies at its first forward (AuxHiddenStatePacker expects 3 captures, gets 2: RuntimeError 'captured 2 of 3 "
        "aux hidden states')")
    assert "shape '[-1, 21504]' is invalid" in f[1]["line"]


def test_the_id_rule_text_and_its_errors():
    assert parse_id_rule("-1=embed, 5=out:4,7=in:7,9=hs:12") == {-1: 0, 5: 5, 7: 7, 9: 12}
    for bad in ("-1", "x=embed", "-1=layer3", "-1=embed,,2=hs:1", "-1=embed,-1=hs:2"):
        with pytest.raises(UsageError):
            parse_id_rule(bad)
    p = plan_for("sglang", "DeepseekV3ForCausalLM", [-1, 2, 30], 61, {-1: 0})
    assert p.crash is None and p.slot_hf_indices == [0, 2, 30]
    assert plan_for("sglang", "DeepseekV3ForCausalLM", [-1, 2, 30], 61).crash.startswith("AuxHiddenStatePacker")


def test_the_seed_on_stock_sglang_shows_every_ids_capture_and_the_ids_to_write(tmp_path):
    res = contract(_write(tmp_path, "draft", SEED), _write(tmp_path, "kimi", KIMI))
    assert [(r["draft_id"], r["draft_expects"], r["target_captures"]) for r in res["rows"]] == [
        (-1, "HF hidden_states[0]", "nothing: the engine crashes"),
        (2, "HF hidden_states[3]", "HF hidden_states[2]"),
        (30, "HF hidden_states[31]", "HF hidden_states[30]")]
    assert res["verdict"]["kind"] == "capture-offset" and res["verdict"]["where"] == "ids 2, 30"
    # one numbering: the draft's slots, in the contract's table, its verdict and the engines' table alike (the
    # crashing id is slot 0, not "-", and the others keep their numbers)
    assert [r["slot"] for r in res["rows"]] == [r["slot"] for r in res["engines"]["rows"]] == [0, 1, 2]
    assert res["verdict"]["detail"] == ("slot 1 (id 2) equals layer 1's output, expected layer 2's output; slot 2 "
                                        "(id 30) equals layer 29's output, expected layer 30's output: one layer "
                                        "early (the EAGLE-3 +1 was not applied) (besides the crash)")
    # the two engines side by side: SGLang's crash on id -1 does not blank what ids 2 and 30 capture there
    assert [(r["draft_id"], r["draft_expects"], r["sglang"]) for r in res["engines"]["rows"]] == [
        (-1, 0, None), (2, 3, 2), (30, 31, 30)]
    assert res["proposal"] == {
        "ids": [0, 3, 31], "field": "eagle_config.eagle_aux_hidden_state_layer_ids",
        "line": "write eagle_config.eagle_aux_hidden_state_layer_ids = [0, 3, 31] for this draft on SGLang: it then "
                "captures HF hidden_states[0, 3, 31], what the draft expects"}


def test_the_ids_to_write_are_given_for_every_engine_that_misses_what_the_draft_expects(tmp_path):
    """A draft trained with SpecForge's ids [0, 1, 2] (HF hidden_states 1..3) whose config has them at the top level
    only: SGLang reads none (its default), vLLM reads them as written and captures every slot one layer early. The
    FIX is given for both engines, each in the field that engine reads; the seed's draft, which no id list serves
    on vLLM's DeepSeek (it cannot give the embedding), gets SGLang's FIX and vLLM's NO ID LIST FITS, naming it."""
    t = _write(tmp_path, "target", LLAMA)
    d = _write(tmp_path, "draft", {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                                   "eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    r = run_cli(["layers", "--draft-config", str(d), "--target-config", str(t)])
    fixes = [x for x in " ".join(r.stdout.split()).split(" FIX: ")[1:]]
    assert r.returncode == 1 and fixes == [
        "write eagle_config.eagle_aux_hidden_state_layer_ids = [0, 1, 2] for this draft on SGLang: it then captures "
        "HF hidden_states[1, 2, 3], what the draft expects",
        "write eagle_aux_hidden_state_layer_ids = [1, 2, 3] for this draft on vLLM: it then captures HF "
        "hidden_states[1, 2, 3], what the draft expects"], r.stdout
    r = run_cli(["layers", "--draft-config", str(_write(tmp_path, "seed", SEED)), "--target-config",
                 str(_write(tmp_path, "kimi", KIMI)), "--json"])
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and [doc["proposal"]["line"], doc["engines"]["fixes"]["vllm"]["line"]] == [
        "write eagle_config.eagle_aux_hidden_state_layer_ids = [0, 3, 31] for this draft on SGLang: it then captures "
        "HF hidden_states[0, 3, 31], what the draft expects",
        "no id list gives the embedding on vLLM: patch DeepseekV2Model.forward "
        "(vllm/model_executor/models/deepseek_v2.py:1508), which offers the loop points to the aux capture"], doc


def test_the_seed_on_the_patched_sglang_from_the_flag_and_from_the_environment(tmp_path):
    d, t = _write(tmp_path, "draft", SEED), _write(tmp_path, "kimi", KIMI)
    res = contract(d, t, id_rule={-1: 0})
    assert [(r["slot"], r["target_captures"], r["ok"]) for r in res["rows"]] == [
        (0, "HF hidden_states[0]", True), (1, "HF hidden_states[2]", False), (2, "HF hidden_states[30]", False)]
    assert res["proposal"]["ids"] == [-1, 3, 31]
    out = []
    for extra, env in ((["--id-rule", "-1=embed"], None), ([], {"TPPROBE_ID_RULE": "-1=embed"})):
        r = run_cli(["layers", "--draft-config", str(d), "--target-config", str(t), "--json", *extra], env=env)
        assert r.returncode == 1, r.stderr
        out.append(json.loads(r.stdout))
    assert out[0]["proposal"] == out[1]["proposal"] == res["proposal"]
    assert out[0]["id_rule"] == {"-1": 0}
    r = run_cli(["layers", "--draft-config", str(d), "--target-config", str(t), "--id-rule", "-1=embeding"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.strip() == ("tpprobe: error: --id-rule '-1=embeding': write ID=WHAT with WHAT one of embed, out:K "
                                "(layer K's output), in:K (the stream entering layer K), hs:N (HF hidden_states[N]); "
                                "e.g. -1=embed")


def test_a_draft_of_the_last_layers_output_on_sglang_says_what_to_patch(tmp_path):
    draft = dict(SEED, eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 30, 60]})
    res = contract(_write(tmp_path, "draft", draft), _write(tmp_path, "kimi", KIMI))
    assert res["proposal"] == {
        "ids": None, "field": "eagle_config.eagle_aux_hidden_state_layer_ids",
        "line": "no id list gives the last layer's output (HF hidden_states[61]) on SGLang: patch "
                "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture and the decoder loop it feeds "
                "(sglang/srt/models/kimi_k25.py:928)"}


def test_the_cli_prints_f30_and_f31_with_exit_1(tmp_path):
    t = _write(tmp_path, "target", LLAMA)
    d = _write(tmp_path, "draft", {"architectures": ["LlamaForCausalLMEagle3"],
                                   "eagle_aux_hidden_state_layer_ids": [4, 1, 5]})
    r = run_cli(["layers", "--draft-config", str(d), "--target-config", str(t)])
    text = " ".join(r.stdout.split())
    assert r.returncode == 1, r.stderr      # the slot verdict once crashed on a draft id past the last layer
    assert "FAILURE ids-out-of-order (F30): vLLM (v1 and v2 model runners): ids [4, 1, 5]" in text
    assert ("FAILURE id-beyond-last-layer (F31): vLLM (v1 and v2 model runners): id 5 (eagle_aux_hidden_state_layer_"
            "ids) is beyond the last layer of this 4-layer target") in text


def test_the_plugins_slot_expectations_go_through_the_same_rule(monkeypatch):
    """SGLang's plugin reads a live model's layers_to_capture; with TPPROBE_ID_RULE the ids are recovered
    through the architecture's own setter rule and the build's rule applied; without it, the stock reading."""
    from tpprobe.engines.capture_rule import sglang_live_slots, vllm_knob_slots
    from tpprobe.engines.sglang.layer_ids import slots_from_layers_to_capture
    monkeypatch.delenv("TPPROBE_ID_RULE", raising=False)
    stock = slots_from_layers_to_capture([-1, 2, 30], 61)
    assert sglang_live_slots("DeepseekV2ForCausalLM", [-1, 2, 30], 61) == (stock, "")
    monkeypatch.setenv("TPPROBE_ID_RULE", "-1=embed")
    (points, ids), note = sglang_live_slots("DeepseekV2ForCausalLM", [-1, 2, 30], 61)
    assert (points, ids) == (["embed.out", "layer.1.out", "layer.29.out"], [-1, 2, 30])
    assert note == ("your build (TPPROBE_ID_RULE=-1=embed): id -1 = embedding output (= HF hidden_states[0])")
    # Llama's +1: layers_to_capture [0, 3, 31] came from ids [-1, 2, 30]; the rule names no captured id's change
    assert sglang_live_slots("LlamaForCausalLM", [0, 3, 31], 61)[0] == (
        ["embed.out", "layer.2.out", "layer.30.out"], [-1, 2, 30])
    monkeypatch.setenv("TPPROBE_ID_RULE", "-1=emb")
    assert sglang_live_slots("DeepseekV2ForCausalLM", [-1, 2, 30], 61)[0] == stock
    # vLLM's knob (tpprobe ids i -> vLLM ids i + 1), the rule keyed by vLLM's ids
    assert vllm_knob_slots([1, 4], {5: 0}) == ((["embed.out", "layer.1.out"], [4, 1]),
                                               "your build (TPPROBE_ID_RULE=5=embed), keyed by vLLM's ids")
    assert vllm_knob_slots([1, 4], {}) == ((["layer.1.out", "layer.4.out"], [1, 4]), "")


def test_sglangs_deepseek_rule_reads_the_lists_order_so_the_ids_to_write_may_be_out_of_order(tmp_path):
    """The example draft expects hidden_states[1, 30, 58] on a DeepSeek-V3 target: [1, 30, 58] would make
    SGLang add 1 to every id (its first id is 1); [30, 1, 58] gives exactly the slots the draft expects."""
    draft = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                           [0, 29, 57]}}
    target = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61, "hidden_size": 7168}
    res = contract(_write(tmp_path, "draft", draft), _write(tmp_path, "target", target))
    assert res["proposal"]["ids"] == [30, 1, 58]
    assert res["proposal"]["line"].endswith(
        "(in this order on purpose: [1, 30, 58] would give HF hidden_states[2, 31, 59], since the rule reads the "
        "list's order; the slots come out in layer order either way)")
    f = findings({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [30, 1, 58]}}, "DeepseekV3ForCausalLM", 61,
                 7168)
    assert f[0]["who"] == "SGLang" and f[0]["line"].endswith(
        "unless the draft was trained in layer order: this engine's rule reads the list's order (written as [1, 30, "
        "58] the ids give HF hidden_states[2, 31, 59]), so the order may be on purpose; tpprobe fix tells which "
        "from the draft's weights")


def test_vllms_deepseek_cannot_capture_id_0():
    """vLLM's DeepseekV2Model offers point 0 but adds hidden_states + residual there while its residual is still
    None: id 0 crashes the engine (run in tests/engines/vllm/test_vllm_probe.py), it is never an embedding slot."""
    from tpprobe.engines.vllm.layer_ids import plan

    p = plan("DeepseekV3ForCausalLM", [0, 3, 7], 12)
    assert p.crash == ("DeepseekV2Model.forward (vllm/model_executor/models/deepseek_v2.py:1508) captures "
                       "hidden_states + residual before layer 0, where its residual is still None: TypeError at the "
                       "first forward")
    assert [(r.requested, r.status, r.slot, r.hf_index) for r in p.rows] == [
        (0, "crash", None, None), (3, "ok", 0, 3), (7, "ok", 1, 7)]
    assert plan("LlamaForCausalLM", [0, 3, 7], 12).crash is None       # vLLM's Llama captures the embedding at 0


def test_the_target_config_alone_gives_its_own_architecture_and_depth(tmp_path):
    # the hub's Kimi-K2.5 config (a wrapper: the text model under text_config) with the seed's ids: what each
    # captures on it, as `--arch kimi --num-layers 61` would; a draft's config there is refused
    t = _write(tmp_path, "kimi", KIMI)
    alone = run_cli(["layers", "--target-config", str(t), "--ids", "-1,2,30", "--json"])
    by_hand = run_cli(["layers", "--arch", "KimiK25ForConditionalGeneration", "--num-layers", "61",
                       "--ids", "-1,2,30", "--json"])
    assert alone.returncode == by_hand.returncode == 1, alone.stderr
    doc = json.loads(alone.stdout)
    assert doc == json.loads(by_hand.stdout)
    assert doc["class"] == "KimiK25ForConditionalGeneration" and doc["layers_to_capture"] == [-1, 2, 30]
    assert doc["problems"] == ["id -1: crash"]
    vllm = json.loads(run_cli(["layers", "--target-config", str(t), "--engine", "vllm", "--json"]).stdout)
    assert [r["hf_index"] for r in vllm["rows"]] == [2, 30, 58]       # vLLM's defaults (2, N//2, N-3) on 61 layers
    d = _write(tmp_path, "draft", SEED)
    bad = run_cli(["layers", "--target-config", str(d)])
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert f"--target-config {d} is an EAGLE-3 draft's config (LlamaForCausalLMEagle3)" in bad.stderr
