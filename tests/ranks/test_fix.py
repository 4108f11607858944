"""`tpprobe fix` and tpprobe.eagle3.fix: the draft replayed on candidate captures of the target's streams,
the best turned into ids for the engine's rule, or what to patch when no id list gives it.

The drafts are built by hand (tests/zoo/drafts.py): each reads exactly the streams it was built on,
in that order, so the right capture replays at 1.00 and the proposal can be asserted exactly. The
seed's case is a DeepSeek-V3 target of 61 layers (Kimi-K2.5's text model) and a draft whose config
says [-1, 2, 30] and that was trained on cat([embedding, hidden_states[3], hidden_states[31]]).
"""
from __future__ import annotations

import json

import pytest

from tests.zoo.drafts import hand_draft, planted_streams
from tests.helpers.ranks import run_cli
from tpprobe.eagle3.accept.draft import load_draft
from tpprobe.eagle3.fix import SHOWN, EngineRule, propose, streams_from_capture

DS = "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    s = planted_streams(61)
    return s, load_draft(hand_draft(s, [0, 3, 31], tmp_path_factory.mktemp("seed") / "draft", [-1, 2, 30]))


def test_the_seeds_draft_on_stock_sglang_gets_ids_that_give_the_embedding(seed):
    s, d = seed
    p = propose(d, s, EngineRule("sglang", DS, 61))
    assert p.fix_ids == [0, 3, 31] and p.no_fix is None
    assert p.line == ("set eagle_config.eagle_aux_hidden_state_layer_ids to [0, 3, 31]: replayed first-position "
                      "acceptance 0.00 -> 1.00 (accept length, chain of 5: 1.00 -> 6.00)")
    assert p.notes == ["the engine does not serve these ids as they are: id -1: crash"]
    assert p.best.streams == [0, 3, 31] and p.best.score.per_position == [1.0] * 5


def test_every_candidate_the_table_shows_has_the_ids_that_give_it_or_none_do(seed):
    s, d = seed
    rule = EngineRule("sglang", DS, 61)
    p = propose(d, s, rule)
    shown = p.candidates[:SHOWN]
    assert len(shown) == SHOWN and all(c.searched for c in shown)
    for c in shown:
        assert c.ids is None or rule.slots(c.ids) == c.streams, c
    # past the first five too: SGLang's DeepSeek takes ids as given unless the first is 1 (then +1 to every
    # one), so HF hidden_states[1] in slot 0 is out of reach and the others are their own ids
    assert [(c.streams, c.ids) for c in shown[5:]] == [([0, 1, 31], [0, 1, 31]), ([1, 3, 31], None),
                                                      ([0, 2, 31], [0, 2, 31])]
    assert all(c.as_dict()["ids_searched"] is False and c.ids is None for c in p.candidates[SHOWN:])


def test_the_seeds_draft_on_the_patched_sglang_moves_ids_2_and_30_one_layer(seed):
    s, d = seed
    p = propose(d, s, EngineRule("sglang", DS, 61, {-1: 0}))
    assert p.current.streams == [0, 2, 30]          # the patch gives the embedding; 2 and 30 read one layer early
    assert p.fix_ids == [-1, 3, 31]
    assert p.line == ("set eagle_config.eagle_aux_hidden_state_layer_ids to [-1, 3, 31]: replayed first-position "
                      "acceptance 0.35 -> 1.00 (accept length, chain of 5: 1.50 -> 6.00)")


def test_a_draft_trained_on_the_last_layers_output_has_no_id_list_on_sglang_and_one_on_vllm(tmp_path):
    s = planted_streams(12)
    d = load_draft(hand_draft(s, [0, 6, 12], tmp_path / "d", [-1, 5, 11]))
    p = propose(d, s, EngineRule("sglang", DS, 12))
    assert p.fix_ids is None and p.best.streams == [0, 6, 12]
    assert p.no_fix == ("no id list gives the last layer's output (HF hidden_states[12]) on this engine: patch "
                        "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture and the decoder loop it feeds "
                        "(sglang/srt/models/deepseek_v2.py:3458) (or describe a patched build with --id-rule)")
    assert p.reachable is not None and p.reachable.score.first_position < 1.0
    assert "; the best this engine can give: set eagle_config.eagle_aux_hidden_state_layer_ids to " in p.line
    v = propose(d, s, EngineRule("vllm", "LlamaForCausalLM", 12))
    assert v.fix_ids == [0, 6, 12] and v.line.startswith(
        "set eagle_aux_hidden_state_layer_ids to [0, 6, 12]: replayed first-position acceptance 0.00 -> 1.00")


def test_a_draft_trained_with_the_embedding_has_no_id_list_on_vllms_deepseek(tmp_path):
    """vLLM 0.32's DeepseekV2Model cannot capture id 0 (before layer 0 its residual is None and the forward raises):
    no id list gives the embedding there, so the fix names the code to patch and the best the engine can give."""
    s = planted_streams(12)
    d = load_draft(hand_draft(s, [0, 6, 12], tmp_path / "d", [-1, 5, 11]))
    v = propose(d, s, EngineRule("vllm", DS, 12))
    assert v.fix_ids is None and v.best.streams == [0, 6, 12]
    assert v.no_fix == ("no id list gives the embedding on this engine: patch DeepseekV2Model.forward "
                        "(vllm/model_executor/models/deepseek_v2.py:1508), which offers the loop points to the aux "
                        "capture (or describe a patched build with --id-rule)")
    assert "; the best this engine can give: set eagle_aux_hidden_state_layer_ids to [1, 6, 12]" in v.line, v.line


def test_an_architecture_outside_sglangs_code_says_which_streams_are_unknown_not_unreachable(tmp_path):
    """MindSporeForCausalLM hands the ids to a model built outside SGLang's code: with --id-rule covering
    the ids written (-1, 5, 11 give HF hidden_states 1, 6, 11), the embedding and hidden_states[12] are not
    known to be out of reach, so the fix says so and asks for the rule, rather than "no id list gives" them."""
    s = planted_streams(12)
    d = load_draft(hand_draft(s, [0, 6, 12], tmp_path / "d", [-1, 5, 11]))
    p = propose(d, s, EngineRule("sglang", "MindSporeForCausalLM", 12, {-1: 1, 5: 6, 11: 11}))
    assert p.fix_ids is None and p.best.streams == [0, 6, 12]
    assert p.current.streams == [1, 6, 11]
    who = "SGLang MindSporeForCausalLM (patched: -1=hs:1,5=hs:6,11=hs:11) hands the ids to code outside SGLang"
    assert p.no_fix == (f"which id gives the embedding is not known here: {who}; give your build's rule for it "
                        f"with --id-rule; which id gives the last layer's output (HF hidden_states[12]) is not "
                        f"known here: {who}; give your build's rule for it with --id-rule")


def test_a_draft_trained_with_slots_out_of_layer_order_names_the_slots_and_the_fc_permutation(tmp_path):
    s = planted_streams(12)
    d = load_draft(hand_draft(s, [3, 0, 7], tmp_path / "d", [2, -1, 6]))
    p = propose(d, s, EngineRule("vllm", "LlamaForCausalLM", 12))
    assert p.fix_ids is None and p.best.streams == [3, 0, 7]
    assert p.no_fix.startswith(
        "the draft reads its slots in the order HF hidden_states[3, 0, 7], and this engine fills slots in ascending "
        "layer order (slot 0 would hold HF hidden_states[0] instead of [3], slot 1 would hold HF hidden_states[3] "
        "instead of [0]): permute the column blocks of the draft's fc.weight to layer order, or patch LlamaModel."
        "forward (vllm/model_executor/models/llama.py:")


def test_a_chain_no_start_position_fits_is_one_line_exit_2(tmp_path):
    """A chain longer than the capture's positions with a label scored every candidate 1.00 -> 1.00: refused."""
    from tests.helpers.ranks import probe
    run = tmp_path / "cap"
    code, _, cp = probe(run, "--tokens", "12", "--vocab", "16", "--layers", "-1,1,3", nproc=1)
    assert code == 0, cp.stderr[-2000:]
    draft = hand_draft(streams_from_capture(run), [0, 2, 4], tmp_path / "draft", [-1, 1, 3])
    args = ["fix", "--draft", str(draft), "--streams", str(run), "--arch", "LlamaForCausalLM", "--engine", "vllm"]
    r = run_cli([*args, "--chain", "1000"])
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
    assert r.stderr == (f"tpprobe: error: --chain 1000: no start position of the 12-token capture {run} fits a "
                        f"chain of 1000 (10 positions have a next-next token to score a draft against); give "
                        f"--chain 10 or less, or capture a longer sequence\n")
    r = run_cli([*args, "--chain", "10"])          # the longest that fits: scored
    assert r.returncode == 1 and "(accept length, chain of 10: 1.00 -> 11.00)" in " ".join(r.stdout.split()), \
        r.stdout + r.stderr


def test_the_cli_on_a_real_probe_capture_keeps_sglangs_ids_and_fixes_vllms(tmp_path):
    """A real 2-rank probe of the built-in model (6 layers, every layer's stream kept), a draft built on
    its streams [0, 2, 4] with SpecForge's ids [-1, 1, 3]: SGLang's +1 gives exactly those; vLLM drops -1."""
    from tests.helpers.ranks import probe
    run = tmp_path / "cap"
    code, _, cp = probe(run, "--tokens", "48", "--vocab", "16", "--layers", "-1,1,3", "--embed-std", "0.01")
    assert code == 0, cp.stderr[-2000:]
    s = streams_from_capture(run)
    assert s.num_layers == 6 and sorted(s.by_hf) == list(range(7))
    draft = hand_draft(s, [0, 2, 4], tmp_path / "draft", [-1, 1, 3])
    args = ["fix", "--draft", str(draft), "--streams", str(run), "--arch", "LlamaForCausalLM"]
    r = run_cli([*args, "--engine", "sglang"])
    assert r.returncode == 0, r.stderr
    assert ("OK: keep eagle_config.eagle_aux_hidden_state_layer_ids [-1, 1, 3]: no candidate capture replays better "
            "than the engine's (1.00 first-position acceptance, accept length 6.00, chain of 5)") in \
        " ".join(r.stdout.split())
    r = run_cli([*args, "--engine", "vllm", "--chain", "3", "--json"])
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "tpprobe.fix/1" and doc["fix_ids"] == [0, 2, 4] and doc["written_ids"] == [-1, 1, 3]
    assert doc["line"] == ("set eagle_aux_hidden_state_layer_ids to [0, 2, 4]: replayed first-position acceptance "
                           "0.00 -> 1.00 (accept length, chain of 3: 1.00 -> 4.00)")
    assert doc["notes"] == ["the engine does not serve these ids as they are: id -1: dropped"]


@pytest.mark.parametrize("extra, message", [
    (["--engine", "trt"], "--engine 'trt': use sglang or vllm"),
    (["--id-rule", "-1=embedd"], "--id-rule '-1=embedd': write ID=WHAT with WHAT one of embed"),
    ([], "--arch or --target-config: give the target's architecture"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, extra, message):
    s = planted_streams(4, tokens=8)
    draft = hand_draft(s, [0, 1, 2], tmp_path / "d", [-1, 0, 1])
    args = ["fix", "--draft", str(draft), "--streams", str(tmp_path)]
    r = run_cli(args + (["--arch", "LlamaForCausalLM"] if extra and extra[0] != "--arch" else []) + extra)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_training_sample_finds_streams_no_neighbourhood_of_the_config_reaches(tmp_path):
    """The config says [-1, 2, 4]; the draft was trained on hidden_states[0, 6, 11]: none of the candidates
    around the config reaches it, the training sample (SpecForge's file, same tokens) does."""
    from tpprobe.eagle3.diff.load import load_side
    from tpprobe.formats.specforge import write_sample
    s = planted_streams(12)
    d = load_draft(hand_draft(s, [0, 6, 11], tmp_path / "d", [-1, 2, 4]))
    rule = EngineRule("vllm", "LlamaForCausalLM", 12)
    blind = propose(d, s, rule)
    assert blind.best.streams != [0, 6, 11] and blind.best.score.first_position < 0.9
    sample = write_sample(tmp_path / "data_0.ckpt", s.input_ids, s.packed([0, 6, 11]))
    p = propose(d, s, rule, trained_on=load_side("trained-on", sample).packed)
    assert p.best.label == "the training sample" and p.fix_ids == [0, 6, 11]
    assert p.line.startswith("set eagle_aux_hidden_state_layer_ids to [0, 6, 11]: replayed first-position "
                             "acceptance ") and p.line.endswith("-> 1.00 (accept length, chain of 5: "
                                                                f"{p.current.score.accept_length:.2f} -> 6.00)")


# ---- scored against the target's own tokens: the planted vLLM target and draft (tpprobe.engines.vllm.planted) ----
def _planted(tmp_path):
    import torch

    from tpprobe.cli.drafter import target_embedding
    from tpprobe.engines.vllm import planted as pl
    target = pl.build_target(tmp_path / "target")
    draft = load_draft(pl.build_draft(tmp_path / "draft", [1, 2, 3]), target_embedding(str(target), tmp_path))
    code = pl.codes()

    def streams(prompt):
        """The planted target's streams, as its doc gives them: HF hidden_states[k] holds each token's code in
        block k and the constant in the last dim."""
        from tpprobe.eagle3.fix import streams_from_tensors
        ids = torch.tensor(prompt)
        by = {}
        for k in range(pl.L + 1):
            t = torch.zeros(len(prompt), pl.H)
            t[:, pl.BLOCK * k:pl.BLOCK * (k + 1)] = code[ids]
            t[:, pl.CONST] = pl.C
            by[k] = t
        return streams_from_tensors(ids, by, pl.L)
    return pl, str(target), draft, streams


def test_the_targets_head_gives_its_greedy_next_token_at_every_position(tmp_path):
    from tpprobe.eagle3.target_head import greedy_next
    pl, target, _, streams = _planted(tmp_path)
    prompt = [5, 17, 99, 3, 250, 41, 77, 8]
    nxt, how = greedy_next(target, streams(prompt).by_hf[pl.L])
    f = pl.next_token()
    assert nxt.tolist() == [f[t] for t in prompt]
    assert how == "the target's own greedy tokens (model.norm.weight and lm_head.weight of target on the last layer)"
    assert greedy_next(str(tmp_path / "nowhere"), streams(prompt).by_hf[pl.L])[0] is None


def test_a_replay_scores_the_draft_against_the_targets_tokens_not_the_prompts(tmp_path):
    """vLLM verifies a draft against the target's own tokens. The planted draft is right on every position where
    the prompt goes on as the target would (as in decode), whatever the rest of the prompt is: scored against the
    prompt it read 0.67 on a partly ordinary prompt and 0.00 on an ordinary one, where vLLM accepts every draft."""
    from tpprobe.eagle3.target_head import score_on_target
    from tpprobe.eagle3.fix import replay
    pl, target, draft, streams = _planted(tmp_path)
    f = pl.next_token()
    chain = [99]
    while len(chain) < 6:
        chain.append(f[chain[-1]])
    mixed = streams([5, 17] + chain)                      # 2 ordinary tokens, then the target's own text
    assert replay(draft, mixed, [1, 2, 3], chain=2).first_position == pytest.approx(4 / 6)   # the prompt's as labels
    scored, why = score_on_target(mixed, target)
    assert why == "" and mixed.decode_like == 5
    assert scored == ("scored against the target's own greedy tokens (model.norm.weight and lm_head.weight of "
                      "target on the last layer) at the 5 of 7 positions where the prompt follows them")
    right, wrong = replay(draft, mixed, [1, 2, 3], chain=2), replay(draft, mixed, [2, 3, 4], chain=2)
    assert (right.first_position, right.accept_length, right.per_position) == (1.0, 3.0, [1.0, 1.0])
    assert (wrong.first_position, wrong.accept_length) == (0.0, 1.0)
    plain = streams([5, 17, 99, 3, 250, 41, 77, 8])       # none of it the target's text: no replay, said why
    assert replay(draft, plain, [1, 2, 3]).first_position == 0.0
    scored, why = score_on_target(plain, target)
    assert scored == "" and why.startswith("the captured prompt is not text the target writes: 0 of its 7 next "
                                           "tokens are the target's own greedy choice")


def _drafter_folder(folder, s, pl):
    """A vLLM plugin step's drafter/ folder as the plugin writes it (rank-000.json: the requests, the layers;
    rank-000.safetensors: the target's token ids and every stream) for the streams `s` of one prompt."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    save_file({"target_token_ids": s.input_ids, **{f"stream.{k}": v for k, v in s.by_hf.items()}},
              str(folder / "rank-000.safetensors"))
    (folder / "rank-000.json").write_text(json.dumps({
        "source": "vllm-plugin drafter", "num_layers": pl.L, "tp_rank": 0,
        "requests": [{"index": 0, "rows": [0, s.input_ids.numel()], "kind": "prefill"}]}))
    return folder


def test_the_cli_scores_against_the_targets_own_tokens_when_its_folder_is_given(tmp_path):
    """`tpprobe fix --embed TARGET_DIR` (or --target-config TARGET_DIR) scores the draft as the live report's replay
    does: against the target's own greedy tokens (its head on the captured last layer), at the positions where the
    prompt goes on as the target would. The prompt here starts with 2 ordinary tokens: scored against the prompt the
    ids it names read 0.00 -> 0.67 (accept length 1.00 -> 1.00), where vLLM would accept every draft they serve.
    Without the target's folder (--embed a file) the prompt is the label, and the output says so; a prompt the
    target did not write is one line, exit 2, as the live report gives no replay for it."""
    from tpprobe.cli.drafter import target_embedding
    pl, target, _, streams = _planted(tmp_path)
    draft = pl.build_draft(tmp_path / "d2", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3])
    f = pl.next_token()
    prompt = [7, 400, 99]
    while len(prompt) < 8:
        prompt.append(f[prompt[-1]])
    cap = _drafter_folder(tmp_path / "step" / "drafter", streams(prompt), pl)
    args = ["fix", "--draft", str(draft), "--streams", str(cap), "--engine", "vllm", "--arch", "LlamaForCausalLM"]
    fixed = ("FIX: set eagle_aux_hidden_state_layer_ids to [0, 2, 3]: replayed first-position acceptance 0.00 -> 1.00 "
             "(accept length, chain of 5: 1.00 -> 6.00)")
    on_target = ("replay scored against the target's own greedy tokens (model.norm.weight and lm_head.weight of "
                 "target on the last layer) at the 5 of 7 positions where the prompt follows them")
    for extra in (["--embed", target], ["--embed", str(target_embedding(target, tmp_path)), "--target-config", target]):
        r = run_cli([*args, *extra])
        out = " ".join(r.stdout.split())
        assert r.returncode == 1 and on_target in out and out.endswith(fixed), r.stdout + r.stderr
    r = run_cli([*args, "--embed", str(target_embedding(target, tmp_path)), "--json"])
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["scored_against"] == (
        "scored against the prompt's next tokens (the target's folder was not given: --embed or --target-config "
        "naming it scores against the target's own greedy tokens)"), doc["scored_against"]
    assert doc["line"] == ("set eagle_aux_hidden_state_layer_ids to [0, 2, 3]: replayed first-position acceptance "
                           "0.00 -> 0.67 (accept length, chain of 5: 1.00 -> 1.00)"), doc["line"]
    plain = _drafter_folder(tmp_path / "plain" / "drafter", streams([5, 17, 99, 3, 250, 41, 77, 8]), pl)
    r = run_cli(["fix", "--draft", str(draft), "--streams", str(plain), "--engine", "vllm", "--arch",
                 "LlamaForCausalLM", "--embed", target])
    assert (r.returncode, r.stderr.strip()) == (2, (
        f"tpprobe: error: --streams {plain}: the captured prompt is not text the target writes: 0 of its 7 next "
        f"tokens are the target's own greedy choice, and the draft is verified against the target's tokens; capture "
        f"a prompt the target wrote (its own greedy output fed back) for a replay")), r.stderr


def test_of_captures_that_replay_alike_the_fix_is_one_the_engine_can_give(tmp_path):
    """The planted draft reads slot 1 only: [0, 2, 1] (no id list gives that order on vLLM) and [0, 2, 3] replay
    alike; the fix is [0, 2, 3]'s ids, not "no id list fits" with [0, 2, 3] as a fallback."""
    from tpprobe.cli.drafter import target_embedding
    pl, target, _, streams = _planted(tmp_path)
    draft = load_draft(pl.build_draft(tmp_path / "d2", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3]),
                       target_embedding(target, tmp_path))
    f = pl.next_token()
    prompt = [11]
    while len(prompt) < 8:
        prompt.append(f[prompt[-1]])
    p = propose(draft, streams(prompt), EngineRule("vllm", "LlamaForCausalLM", 4), ids=[0, 1, 2])
    assert p.no_fix is None and p.fix_ids is not None and p.best.score.first_position == 1.0, p.line
    assert EngineRule("vllm", "LlamaForCausalLM", 4).slots(p.fix_ids)[1] == 2, p.fix_ids
    assert p.line.startswith(f"set eagle_aux_hidden_state_layer_ids to {p.fix_ids}: replayed first-position "
                             f"acceptance 0.00 -> 1.00"), p.line


def test_the_ids_served_far_from_the_drafts_config_still_find_the_config_s_capture(seed):
    """Served ids a config shifted by one layer ([3, 31, 59]): the candidates around them never reach the streams
    the draft reads, the two readings of the draft's own config ids ([-1, 2, 30]) do."""
    s, d = seed
    p = propose(d, s, EngineRule("sglang", DS, 61), ids=[3, 31, 59])
    assert p.fix_ids == [0, 3, 31] and p.best.label.startswith("the draft's config ids as outputs"), p.line
    assert p.line.startswith("set eagle_config.eagle_aux_hidden_state_layer_ids to [0, 3, 31]: replayed first-position "
                             "acceptance 0.04 -> 1.00"), p.line


def test_a_gain_under_the_threshold_is_keep_and_exit_0_not_a_fix(seed, monkeypatch):
    """The line and the exit code say the same: a best candidate within GAIN of the engine's capture is no fix."""
    import tpprobe.eagle3.fix as fx
    s, d = seed
    real = fx.replay

    def replay(draft, streams, hfs, chain=5, engine=None):     # the engine's [3, 31, 59] 0.10, [4, 31, 59] 0.13
        sc = real(draft, streams, hfs, chain, engine)
        sc.first_position = {(3, 31, 59): 0.10, (4, 31, 59): 0.13}.get(tuple(hfs), 0.0)
        return sc
    monkeypatch.setattr(fx, "replay", replay)
    monkeypatch.setattr(d, "layer_ids", [3, 31, 59])
    p = propose(d, s, EngineRule("sglang", DS, 61), ids=[3, 31, 59])
    assert p.best.streams == [4, 31, 59] and p.fix_ids is None and p.no_fix is None and not p.explained
    assert p.line.startswith("keep eagle_config.eagle_aux_hidden_state_layer_ids [3, 31, 59]: the best candidate "
                             "capture, HF hidden_states[4, 31, 59], replays within 0.05 of the engine's (replayed "
                             "first-position acceptance 0.10 -> 0.13"), p.line
