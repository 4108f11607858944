"""SGLang's own tiny Llama / DeepSeek-V2 on real gloo ranks: forwards equal HF, and every packed
EAGLE-3 aux slot holds exactly the HF hidden state that tpprobe.engines.sglang.layer_ids says it does.

One process set per (arch, tp): the model is built once and re-told its ids between forwards.
"""

import json

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang.layer_ids import plan
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 4, 7, 3
# (ids verbatim to set_eagle3_layers_to_capture); None = SGLang's default
LLAMA_IDS = [[-1, 0, 2], [3], [0, 3], [2, 0], None]
DEEPSEEK_IDS = [[0, 2, 3], [1, 2], [2, 0], [-1, 2], [2, 2], None]


def _slots(aux, hs, hidden):
    """For each slot of the packed aux tensor: the HF hidden_states indices it equals."""
    return [[k for k, h in enumerate(hs) if torch.allclose(c, h, atol=1e-4, rtol=1e-4)]
            for c in aux.split(hidden, dim=-1)]


def worker(ctx, arch, id_sets, config_path=None):
    from tpprobe.engines.sglang.tiny import build_target
    from tpprobe.engines.sglang.tiny_weights import hf_reference

    t = build_target(ctx, arch, L, TOKENS, SEED, torch.float32, id_sets[0], config_path=config_path)
    _, hs, logits = hf_reference(arch, L, TOKENS, SEED, config_path=config_path)
    results = []
    for ids in id_sets:
        t.model.set_eagle3_layers_to_capture(ids)
        try:
            out = t.forward()
        except Exception as e:  # noqa: BLE001 - the crash the table predicts
            results.append({"ids": ids, "error": f"{type(e).__name__}: {e}"})
            continue
        aux = t.packed_aux(out)
        results.append({
            "ids": ids, "layers_to_capture": list(t.model.model.layers_to_capture),
            "logit_diff": (out.next_token_logits - logits[-1]).abs().max().item(),
            "slots": None if aux is None else _slots(aux, hs, t.hidden_size),
            "aux": aux,
        })
    return {"info": t.info, "results": results}


def _check(arch, per_rank, id_sets):
    for res in per_rank:
        for ids, r in zip(id_sets, res["results"]):
            p = plan(arch, ids, L)
            if p.crash:
                assert "error" in r, f"{arch} ids {ids}: table says crash ({p.crash}), forward ran"
                if "captured" in p.crash:
                    assert "aux hidden states" in r["error"], r["error"]
                continue
            assert "error" not in r, f"{arch} ids {ids}: table says ok, forward raised {r['error']}"
            assert r["layers_to_capture"] == p.layers_to_capture
            assert r["logit_diff"] < 1e-4
            # each slot equals exactly the HF hidden state the table names, in table order
            assert r["slots"] == [[k] for k in p.slot_hf_indices], (arch, ids, r["slots"])
    # the aux tensor is the full, replicated hidden state: identical on every TP rank
    for i, r0 in enumerate(per_rank[0]["results"]):
        for other in per_rank[1:]:
            if "aux" in r0:
                assert torch.equal(r0["aux"], other["results"][i]["aux"])


def test_llama_tp2_captures_match_hf_and_table():
    per_rank = run_ranks(f"{__name__}:worker", 2,
                         dict(arch="llama", id_sets=LLAMA_IDS), timeout=150)
    _check("llama", per_rank, LLAMA_IDS)
    assert per_rank[0]["info"]["sglang layers_to_capture"] == [0, 1, 3]


def test_deepseek_v2_mla_moe_tp2_captures_match_hf_and_table():
    per_rank = run_ranks(f"{__name__}:worker", 2,
                         dict(arch="deepseek_v2", id_sets=DEEPSEEK_IDS), timeout=150)
    _check("deepseek_v2", per_rank, DEEPSEEK_IDS)
    assert "DeepseekV2MoE" in per_rank[0]["info"]["mlp per layer"]


# tp 4 from a config file (through the CLI):
# tests/engines/sglang/test_sglang_probe.py::test_cli_llama_tp4_from_config_file


def test_bad_arch_and_config_are_usage_errors(tmp_path):
    from tpprobe.engines.sglang.tiny import build_target
    from tpprobe.core.target import RankContext

    ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo")
    with pytest.raises(UsageError, match="--arch"):
        build_target(ctx, "gpt2", 2, 4, 0, torch.float32, [0])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        build_target(ctx, "llama", 2, 4, 0, torch.float32, [0], config_path=str(tmp_path / "bad.json"))
    (tmp_path / "ds.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(UsageError, match="use --arch deepseek_v2"):
        build_target(ctx, "llama", 2, 4, 0, torch.float32, [0], config_path=str(tmp_path / "ds.json"))
    with pytest.raises(UsageError, match="crash"):
        build_target(ctx, "llama", 2, 4, 0, torch.float32, [1])   # id L-1 alone
