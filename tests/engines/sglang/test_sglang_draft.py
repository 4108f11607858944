"""The SGLang plugin captures what SGLang's own EAGLE-3 draft (`LlamaForCausalLMEagle3`) receives, on both gloo
ranks, per request, fed as SGLang's EAGLE worker feeds it after a prefill (`EagleDraftExtendInput`, ids
rotated, CaptureHiddenMode.LAST), and `tpprobe report` checks it against what the draft was trained on:
healthy with the training given (zero findings, full coverage); the seed's bug (the engine captures exactly
what the config says, the draft was trained one layer earlier) fails naming each slot, the layer captured
and the layer trained on, and the fix; without the training the verdict says it checked the config only.
"""
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 4, 6, 5
IDS = [0, 1, 2]          # the draft's config: SGLang-Llama +1 -> HF hidden_states [1, 2, 3]
# what the draft was trained on, one phase (a target prefill and the draft's extend) each
PHASES = [{"TPPROBE_DRAFT_TRAINED": "ids:1,2,3"},          # the config is the training: healthy
          {"TPPROBE_DRAFT_TRAINED": "convention:before"},  # trained on hidden_states [0, 1, 2]: the seed's bug
          {}]                                              # training unknown


def worker(ctx):
    import os

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from tpprobe.engines.sglang import tiny_draft
    from tpprobe.engines.sglang.tiny import build_target, packed_aux

    t = build_target(ctx, "llama", L, TOKENS, SEED, torch.float32, IDS)
    draft = tiny_draft.build_draft(tiny_draft.draft_config(t.model.config, IDS), SEED)
    seqs = [t.input_ids[:2], t.input_ids[2:]]        # two requests in one prefill batch
    received = []
    for env in PHASES:
        os.environ.pop("TPPROBE_DRAFT_TRAINED", None)
        os.environ.update(env)
        res = t.forward_batch(seqs)
        aux = packed_aux(res)
        nxt = res.next_token_logits.argmax(-1)
        tiny_draft.draft_extend_for_prefill(draft, seqs, aux, nxt)
        received.append(aux.clone())
    # F19: the draft's ids only at its config's top level; the target (8 layers) reads none and captures its
    # default [2, 4, 5] = hidden_states [2, 4, 5]; the draft was trained on its ids' outputs [1, 2, 3]
    os.environ["TPPROBE_DRAFT_TRAINED"] = "convention:output"
    t8 = build_target(ctx, "llama", 8, TOKENS, SEED, torch.float32, None)
    top = tiny_draft.build_draft(tiny_draft.draft_config(t8.model.config, IDS, top_level_only=True), SEED)
    res = t8.forward_batch(seqs)
    tiny_draft.draft_extend_for_prefill(top, seqs, packed_aux(res), res.next_token_logits.argmax(-1))

    # after a verify, _draft_extend_for_decode hands the draft num_draft_tokens rows per request, of which
    # num_accept_tokens (accept_lens, the bonus included) were accepted: the rest are rejected rows
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    from tpprobe.engines.sglang.draft_input import requests

    verify = EagleDraftExtendInput(hidden_states=torch.zeros(8, 3 * 64), num_accept_tokens=torch.tensor([3, 1]),
                                   num_correct_drafts=torch.tensor([2, 0]), num_tokens_per_req=4,
                                   num_tokens_for_logprob_per_req=4)
    rows = requests(SimpleNamespace(rids=["a", "b"]), verify, 8)
    return {"aux": received, "verify_rows": rows}


def _report(path):
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def _failures(rep):
    return [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"]


def test_draft_input_checked_against_training(tmp_path):
    from tpprobe.formats.capture_dir import load_run

    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "4",
           "TPPROBE_KEEP": "aux.packed"}
    res = run_ranks(f"{__name__}:worker", 2, {}, env=env, timeout=300)
    group = tmp_path / "dp0-pp0"
    assert sorted(p.name for p in group.iterdir()) == [
        f"step-00000{n}-{m}" for n in range(4) for m in ("draft_input", "extend")]
    # what the draft received is the tensor the target packed, the same on both ranks, with each request's rows
    for n in range(3):
        run = load_run(group / f"step-00000{n}-draft_input")
        assert sorted(run.records) == [0, 1]
        for r, rec in run.records.items():
            assert torch.equal(rec.tensors["aux.packed"], res[r]["aux"][n])
            assert rec.meta.extra["draft_model"] == "LlamaForCausalLMEagle3" and rec.meta.extra["spec_info"] == \
                "EagleDraftExtendInput"
            assert rec.meta.extra["requests"] == [{"rid": "0", "first_row": 0, "rows": 2, "accepted_rows": 2},
                                            {"rid": "1", "first_row": 2, "rows": 4, "accepted_rows": 4}]
            assert rec.meta.slot_match == ["layer.0.out", "layer.1.out", "layer.2.out"]
        assert torch.equal(run.records[0].tensors["aux.packed"], run.records[1].tensors["aux.packed"])
    assert res[0]["verify_rows"] == [{"rid": "a", "first_row": 0, "rows": 4, "accepted_rows": 3},
                                     {"rid": "b", "first_row": 4, "rows": 4, "accepted_rows": 1}]

    # the training given and met: zero findings, every point and all L layers covered, every slot as trained
    for step in ("step-000000-draft_input", "step-000000-extend"):
        code, rep = _report(group / step)
        assert (code, rep["findings"]) == (0, []), rep["findings"]
        assert rep["coverage"]["layers_found"] == L and rep["coverage"]["embed"]
        assert [s["ok"] for s in rep["slots"]] == [True] * 3, rep["slots"]

    # the seed's bug: the engine captures exactly what the config says, the draft was trained one layer earlier
    code, rep = _report(group / "step-000001-draft_input")
    assert code == 1 and _failures(rep) == [("capture-offset", "aux slots [0, 1, 2]", [0, 1])], rep["findings"]
    f = rep["findings"][0]
    assert f["evidence"]["class"] == "F32"
    assert (f["evidence"]["captured_hs"], f["evidence"]["trained_hs"]) == ([1, 2, 3], [0, 1, 2])
    assert "one layer late — F32: the engine captures exactly what the draft's config says" in f["detail"]
    assert "slot 0: captured hidden_states[1], trained on hidden_states[0]" in f["detail"]
    assert "slot 2: captured hidden_states[3], trained on hidden_states[2]" in f["detail"]
    assert "set eagle_config.eagle_aux_hidden_state_layer_ids to [-1, 0, 1]" in f["detail"]
    # the target's own step, without hidden_states indices, only says it agrees with itself
    code, rep = _report(group / "step-000001-extend")
    assert code == 0 and [(x["kind"], x["severity"]) for x in rep["findings"]] == [("draft-unverified", "warning")]

    # the whole run: the first step where the draft gets what it was not trained on
    code, rep = _report(tmp_path)
    assert code == 1 and rep["first_divergence"] == {
        "group": "dp0-pp0", "step": 1, "forward_mode": "draft_input", "kind": "capture-offset",
        "where": "aux slots [0, 1, 2]", "ranks": [0, 1]}

    # training unknown: checked against the draft's config only, never HEALTHY for the draft
    code, rep = _report(group / "step-000002-draft_input")
    assert code == 0 and [(x["kind"], x["where"], x["ranks"], x["severity"]) for x in rep["findings"]] == [
        ("draft-unverified", "aux slots", [0, 1], "warning")]
    assert "checked against the draft's config only (ids [0, 1, 2]" in rep["findings"][0]["detail"]
    # F19: the ids where the target side never reads them
    code, rep = _report(group / "step-000003-draft_input")
    assert code == 1 and _failures(rep) == [("id-contract", "aux slots [0, 1, 2]", [0, 1])], rep["findings"]
    f = rep["findings"][0]
    assert f["evidence"]["class"] == "F19" and f["evidence"]["captured_hs"] == [2, 4, 5]
    assert "are at its config's top level" in f["detail"] and "fix: move the ids into eagle_config" in f["detail"]
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(group / "step-000002-draft_input")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "HEALTHY" not in p.stdout and "draft-unverified" in p.stdout, p.stdout[-2000:]


def specforge_worker(ctx, sample_dir):
    """A SpecForge sample given as what the draft was trained on: written from the target's own prefill with
    ids [1, 2, 3] (HF hidden_states [2, 3, 4]), then served with ids [0, 1, 2] (hidden_states [1, 2, 3]: the
    seed's shift), with ids [1, 2, 3] (healthy), and with a sample whose tokens were never served."""
    import os

    import torch.distributed as dist

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from tpprobe.engines.sglang import tiny_draft
    from tpprobe.engines.sglang.tiny import build_target, packed_aux
    from tpprobe.formats.specforge import write_sample

    t = build_target(ctx, "llama", L + 1, TOKENS, SEED, torch.float32, [1, 2, 3])    # hidden_states 0..5
    seqs = [t.input_ids[:2], t.input_ids[2:]]
    aux = packed_aux(t.forward_batch(seqs))                   # step 0: the prefill the sample is written from
    sample, unserved = os.path.join(sample_dir, "data_0.ckpt"), os.path.join(sample_dir, "data_1.ckpt")
    if ctx.rank == 0:                                         # request 1's prompt and its aux rows
        write_sample(sample, seqs[1], aux[2:])
        write_sample(unserved, (seqs[1] + 1) % t.model.config.vocab_size, aux[2:])
    dist.barrier()
    for ids, path in (([0, 1, 2], sample), ([1, 2, 3], sample), ([1, 2, 3], unserved)):     # steps 1, 2, 3
        os.environ["TPPROBE_DRAFT_TRAINED"] = f"specforge:{path}"
        t.model.set_eagle3_layers_to_capture(ids)
        draft = tiny_draft.build_draft(tiny_draft.draft_config(t.model.config, ids), SEED)
        res = t.forward_batch(seqs)
        tiny_draft.draft_extend_for_prefill(draft, seqs, packed_aux(res), res.next_token_logits.argmax(-1))
    return None


def test_a_specforge_sample_is_what_the_draft_input_is_checked_against(tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    out = tmp_path / "capture"
    env = {"TPPROBE_CAPTURE_DIR": str(out), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "4",
           "TPPROBE_KEEP": "aux.packed"}
    run_ranks(f"{__name__}:specforge_worker", 2, {"sample_dir": str(samples)}, env=env, timeout=300)
    group = out / "dp0-pp0"
    sample = samples / "data_0.ckpt"
    # matched at step 1 to request 1's rows: the sample holds hidden_states [2, 3, 4]; served with ids [0, 1, 2]
    # the engine captures [1, 2, 3], exactly what the config says: the seed's shift, with the ids that fix it
    code, rep = _report(group / "step-000001-draft_input")
    assert code == 1 and _failures(rep) == [("capture-offset", "aux slots [0, 1, 2]", [0, 1])], rep["findings"]
    f = rep["findings"][0]
    assert f["evidence"]["class"] == "F32"
    assert (f["evidence"]["captured_hs"], f["evidence"]["trained_hs"]) == ([1, 2, 3], [2, 3, 4])
    assert f"TPPROBE_DRAFT_TRAINED=specforge:{sample}: the SpecForge sample {sample}: its 3 slots are HF " \
           f"hidden_states [2, 3, 4] (matched to the target's streams at step 1 (extend), request 1's rows 2..5" \
        in f["detail"]
    assert "one layer early" in f["detail"] and "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 2, 3]" \
        in f["detail"]
    # the prefill the sample was matched on kept its streams (under the byte budget) to match it
    assert {"embed.out", "layer.4.out"} <= set(load_file(group / "step-000001-extend")), "streams not kept"
    # the fix served: the draft and the target's own step are HEALTHY against the sample, full coverage
    for step in ("step-000002-draft_input", "step-000002-extend"):
        code, rep = _report(group / step)
        assert (code, rep["findings"]) == (0, []), rep["findings"]
        assert rep["coverage"]["layers_found"] == L + 1 and rep["coverage"]["embed"]
        assert [s["ok"] for s in rep["slots"]] == [True] * 3, rep["slots"]
    # after the match a prefill keeps only what TPPROBE_KEEP says
    assert set(load_file(group / "step-000002-extend")) <= {"aux.packed", "input_ids"}
    # a sample whose tokens were never served: checked against the config only, saying why
    code, rep = _report(group / "step-000003-draft_input")
    assert code == 0 and [(x["kind"], x["where"], x["ranks"], x["severity"]) for x in rep["findings"]] == [
        ("draft-unverified", "aux slots", [0, 1], "warning")], rep["findings"]
    assert f"could not be read from TPPROBE_DRAFT_TRAINED=specforge:{samples / 'data_1.ckpt'}: the SpecForge " \
           f"sample" in rep["findings"][0]["detail"] and "shares no 2+ leading tokens with a captured prefill" \
        in rep["findings"][0]["detail"]


def load_file(step) -> dict:
    """Rank 0's kept tensors of a step folder."""
    from tpprobe.formats.capture_dir import load_run

    return load_run(step).records[0].tensors


def short_list_worker(ctx):
    """TPPROBE_DRAFT_TRAINED=ids:1,2 for a draft whose config reads 3 slots (ids [0, 1, 2]): one prefill and the
    draft's extend."""
    import os

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from tpprobe.engines.sglang import tiny_draft
    from tpprobe.engines.sglang.tiny import build_target, packed_aux

    os.environ["TPPROBE_DRAFT_TRAINED"] = "ids:1,2"
    t = build_target(ctx, "llama", L, TOKENS, SEED, torch.float32, IDS)
    draft = tiny_draft.build_draft(tiny_draft.draft_config(t.model.config, IDS), SEED)
    seqs = [t.input_ids[:2], t.input_ids[2:]]
    res = t.forward_batch(seqs)
    tiny_draft.draft_extend_for_prefill(draft, seqs, packed_aux(res), res.next_token_logits.argmax(-1))
    return None


def test_a_training_list_of_another_length_is_refused(tmp_path):
    """A list of 2 HF hidden_states for a draft of 3 slots is not what the draft was trained on slot by slot: the
    plugin says one line naming both lengths (TP rank 0, once), never uses it, and the report checks the draft's
    input against its config only, saying why (as vLLM's drafter does)."""
    from tests.helpers.sglang_ranks import LAST_LOGS

    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "1"}
    run_ranks(f"{__name__}:short_list_worker", 2, {}, env=env, timeout=300)
    draft_why = ("TPPROBE_DRAFT_TRAINED=ids:1,2 gives 2 slot(s), HF hidden_states [1, 2], but the draft reads 3 (its "
                 "config's eagle_config.eagle_aux_hidden_state_layer_ids [0, 1, 2]): give one HF hidden_states index "
                 "per slot, in slot order")
    target_why = ("TPPROBE_DRAFT_TRAINED=ids:1,2 gives 2 slot(s), HF hidden_states [1, 2], but the draft reads 3 (the "
                  "slots SGLang's layers_to_capture gives it): give one HF hidden_states index per slot, in slot order")
    log = "".join(LAST_LOGS)
    said = [x[x.index("] ") + 2:] for x in log.splitlines() if "[tpprobe pid=" in x and "TRAINED" in x]
    assert said == [f"the draft's input: {why}; not used: it is checked against the draft's config only"
                    for why in (target_why, draft_why)], said
    group = tmp_path / "dp0-pp0"
    code, rep = _report(group / "step-000000-draft_input")
    assert code == 0 and [(x["kind"], x["where"], x["ranks"], x["severity"]) for x in rep["findings"]] == [
        ("draft-unverified", "aux slots", [0, 1], "warning")], rep["findings"]
    assert rep["findings"][0]["detail"] == (
        "the aux slots were checked against the draft's config only (ids [0, 1, 2] under the engine's rule: "
        f"hidden_states [1, 2, 3]): what the draft was trained on was refused at capture, not used: {draft_why}")
    assert [s["ok"] for s in rep["slots"]] == [True] * 3, rep["slots"]
    code, rep = _report(group / "step-000000-extend")
    assert code == 0 and [(x["kind"], x["severity"]) for x in rep["findings"]] == [("draft-unverified", "warning")]
    assert rep["findings"][0]["detail"].endswith(f"; what the draft was trained on was refused at capture, not used: "
                                                 f"{target_why}"), rep["findings"][0]["detail"]
