"""From SGLang's draft input to the fix, replayed: SGLang's own target (`LlamaForCausalLM`) and EAGLE-3 draft
(`LlamaForCausalLMEagle3`) at TP 2 over gloo, loaded from HF folders with SGLang's own `load_weights`, the draft fed
as SGLang's EAGLE worker feeds it after a prefill (tpprobe.engines.sglang.tiny_draft), the plugin capturing both.

The weights are tpprobe.engines.vllm.planted's: a target whose every HF hidden_states index is told apart, and a
draft that reads one slot and predicts the token the engine verifies its first draft against only when that
slot holds the stream it was built for. The draft was built for HF hidden_states [0, 1, 2] (it reads
hidden_states[1] in slot 1); its config says [0, 1, 2], which SGLang's Llama rule reads as layer outputs
(hidden_states [1, 2, 3]). SGLang's draft then drafts no right token; `tpprobe report DIR` (on request,
TPPROBE_FIX_REPLAY=1: no SGLang server counts acceptance here) replays the draft, its weights from the folder the
engine loaded, on the captured target forward's streams for candidate id lists, ranks them by replayed
acceptance, names the ids to write and says they explain the draft's acceptance. Served with those ids, SGLang's
own draft drafts every right token.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L = 4
TRAINED = [0, 1, 2]       # HF hidden_states the draft was built for, slot by slot
SERVED = [0, 1, 2]        # its config's ids: SGLang's Llama captures hidden_states [1, 2, 3]
FIELD = "eagle_aux_hidden_state_layer_ids"


def prompts() -> list:
    from tpprobe.engines.vllm.planted import next_token
    f, out = next_token(), []
    for start, n in ((11, 8), (300, 5)):       # prompts the target itself would write
        p = [start]
        while len(p) < n:
            p.append(f[p[-1]])
        out.append(p)
    return out


def worker(ctx):
    import torch

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from tpprobe.engines.sglang import tiny_draft
    from tpprobe.engines.sglang.tiny import build_target, packed_aux

    ids = json.loads(os.environ["TEST_SERVED_IDS"])
    t = build_target(ctx, "llama", L, 8, 0, torch.float32, ids, weights_dir=os.environ["TEST_TARGET"])
    draft = tiny_draft.load_draft(os.environ["TEST_DRAFT"], t.model)
    seqs = [torch.tensor(p) for p in prompts()]
    res = t.forward_batch(seqs)                                # one prefill batch of both prompts
    nxt = res.next_token_logits.argmax(-1)
    out = tiny_draft.draft_extend_for_prefill(draft, seqs, packed_aux(res), nxt)
    return {"next": nxt.tolist(), "drafted": out.next_token_logits.argmax(-1).tolist()}


def serve(tmp_path, target, draft, ids, capture=None) -> list:
    env = {"SGLANG_PLUGINS": "tpprobe", "TEST_TARGET": str(target), "TEST_DRAFT": str(draft),
           "TEST_SERVED_IDS": json.dumps(ids)}
    if capture:
        env.update(TPPROBE_CAPTURE_DIR=str(capture), TPPROBE_MAX_STEPS="1", TPPROBE_KEEP="*")    # the streams, replayed
    return run_ranks(f"{__name__}:worker", 2, {}, env=env, timeout=300)


def right_drafts(res) -> int:
    """Requests whose first draft is the token the target verifies it against: f(the token it sampled)."""
    from tpprobe.engines.vllm.planted import next_token
    f = next_token()
    return sum(d == f[n] for d, n in zip(res[0]["drafted"], res[0]["next"]))


def test_the_draft_replayed_on_sglangs_capture_names_the_ids_and_they_bring_its_drafts_back(tmp_path):
    from tpprobe.engines.vllm.planted import build_draft, build_target

    target = build_target(tmp_path / "target")
    draft = build_draft(tmp_path / "draft", SERVED, read_slot=1, trained_ids=TRAINED)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"] = {FIELD: SERVED, "use_aux_hidden_state": True}      # where SGLang's target side reads them
    (draft / "config.json").write_text(json.dumps(cfg))
    cap = tmp_path / "cap"
    res = serve(tmp_path, target, draft, SERVED, cap)
    assert res[0] == res[1] and right_drafts(res) == 0, res      # SGLang's draft: no right first draft of 2

    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap), "--json"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "TPPROBE_FIX_REPLAY": "1"})
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout)
    rp = rep["draft_replay"]
    assert rp["available"] and rp["engine"] == "sglang" and rp["written_ids"] == SERVED, rp
    assert rp["current"]["streams"] == [1, 2, 3] and rp["current"]["score"]["first_position"] == 0.0, rp["current"]
    fix = rp["fix_ids"]
    assert rp["best"]["streams"][1] == 1 and rp["best"]["score"]["first_position"] == 1.0, rp["best"]
    assert rp["line"] == (f"set eagle_config.{FIELD} to {fix}: replayed first-position acceptance 0.00 -> 1.00 "
                          f"(accept length, chain of 5: 1.00 -> 6.00)"), rp["line"]
    # nothing else fails: the replay is the cause, named where the draft's input was captured, on both ranks
    fails = [f for f in rep["findings"] if f["severity"] == "failure"]
    assert [(f["kind"], f["where"], f["ranks"]) for f in fails] == \
        [("id-contract", "aux slots, step 0 (draft_input)", [0, 1])], rep["findings"]
    assert f"set eagle_config.{FIELD} to {fix}" in fails[0]["detail"] and "replayed on" in fails[0]["detail"], fails[0]
    line = f"draft replay: fix (the draft replayed on {rp['on']}): {rp['line']}"
    assert rep["settings"]["draft replay"] == line[len("draft replay: "):], rep["settings"]
    # every sink says it
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap), "--html", str(html), "--markdown",
                        str(md)], capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                                   "TPPROBE_FIX_REPLAY": "1"})
    assert p.returncode == 1 and line in " ".join(p.stdout.split()), p.stdout[-3000:]
    from html import escape
    assert line in md.read_text() and escape(line) in html.read_text()

    # the ids applied: SGLang's own draft drafts the right token for both requests
    res2 = serve(tmp_path, target, draft, fix)
    assert res2[0]["next"] == res[0]["next"] and right_drafts(res2) == 2, (fix, res2)
