"""The seed's four guesses about Kimi-K2.5's 30 % acceptance, each a fault on SGLang's own DeepSeek/Kimi model
(`--engine sglang --arch kimi_k2`, SGLang's DeepseekV3ForCausalLM on CPU gloo), made the way the code would be
wrong (tpprobe/engines/sglang/faults.py), and each named exactly: class, place, ranks.

1. a TP-sliced capture (F6): the aux capture stores each rank's hidden/tp slice -> tp-sliced at aux.packed;
2. an embedding without its all-reduce (F1): SGLang's VocabParallelEmbedding under its own input-scattered flag
   -> partial-allreduce at the embedding;
3. the "embedding" taken after the first dense layer (F13): the capture rule puts the embedding's slot at capture
   point 1 -> transformed-capture at aux slot 0, "one layer late", never "+1 applied twice";
4. a clone vs hidden + residual (F18): the capture stores the layer's output alone -> capture-no-residual.
Guesses 1 and 3 run in CI; 2 and 4 (the same mechanisms CI proves on the plugin's and on qwen3's runs) are sweep.
The wording of the slot verdicts is checked without ranks.
"""

import pytest

from tests.engines.sglang.test_sglang_probe import failures, probe
from tpprobe.engines.sglang import INSTALL_HINT, available

needs_sglang = [pytest.mark.sglang, pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

GUESSES = [
    pytest.param("slice-capture", "tp-sliced", "aux.packed", "each slot is a TP slice", marks=needs_sglang),
    pytest.param("skip-embed-allreduce", "partial-allreduce", "embedding (model.embed_tokens)",
                 "no all-reduce ran in the embedding", marks=[*needs_sglang, pytest.mark.sweep]),
    pytest.param("embed-after-layer0", "transformed-capture", "aux slot 0",
                 "the \"embedding\" is taken after the first decoder layer ran: a transformed capture, one layer late",
                 marks=needs_sglang),
    pytest.param("capture-no-residual", "capture-no-residual", "aux slot 1", "without the residual",
                 marks=[*needs_sglang, pytest.mark.sweep]),
]


@pytest.mark.parametrize("inject,kind,where,says", GUESSES)
def test_each_guess_is_named_on_sglangs_kimi_model(tmp_path, inject, kind, where, says):
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", "kimi_k2", "--inject", inject)
    assert code == 1, p.stderr[-3000:]
    f = failures(rep)
    assert [(x["kind"], x["where"], x["ranks"]) for x in f] == [(kind, where, [0, 1])], rep["findings"]
    assert says in f[0]["detail"], f[0]["detail"]
    assert "applied twice" not in p.stdout
    assert rep["settings"]["arch"] == "deepseek_v2" and rep["settings"]["layer_ids"] == [0, 2]


def test_an_embedding_one_layer_late_is_transformed_not_plus_one_twice():
    from tpprobe.checks.slots import slot_verdict

    kind, where, detail = slot_verdict([0, 2, 4], ["embed.out", "layer.1.out", "layer.3.out"],
                                       ["layer.0.out", "layer.1.out", "layer.3.out"], 6)
    assert (kind, where) == ("transformed-capture", "aux slot 0")
    assert "one layer late" in detail and "applied twice" not in detail
    # every slot one layer late under a +1 rule: that IS the rule applied twice
    kind, where, detail = slot_verdict([-1, 1, 3], ["embed.out", "layer.1.out", "layer.3.out"],
                                       ["layer.0.out", "layer.2.out", "layer.4.out"], 6)
    assert (kind, where) == ("capture-offset", "aux slots [0, 1, 2]") and "applied twice" in detail
    # the ids after the embedding one layer early, the embedding right: +1 not applied
    kind, _, detail = slot_verdict([-1, 1, 3], ["embed.out", "layer.1.out", "layer.3.out"],
                                   ["embed.out", "layer.0.out", "layer.2.out"], 6)
    assert kind == "capture-offset" and "one layer early (the EAGLE-3 +1 was not applied)" in detail
    # one slot late among right ones: one layer late, no rule blamed
    kind, _, detail = slot_verdict([0, 2, 4], ["embed.out", "layer.1.out", "layer.3.out"],
                                   ["embed.out", "layer.2.out", "layer.3.out"], 6)
    assert kind == "capture-offset" and detail.endswith("one layer late")
