"""Every tiny SGLang architecture tpprobe builds (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2) on
real gloo ranks: the forward equals HF, and every packed EAGLE-3 aux slot holds exactly the HF
hidden state that the rule derived from SGLang's own setter (tpprobe.engines.sglang.rules via
tpprobe.engines.sglang.layer_ids.plan) says it does, including the ids that crash or are dropped.

Several architectures per rank process: SGLang's parallel state is published once.
"""

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang.layer_ids import plan
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 4, 5, 3
IDS = {
    "qwen3": [[-1, 0, 2], [0, 3], None],
    "qwen3_moe": [[-1, 0, 2], [0, 3], [-2, 1], None],      # 3 -> layer 4 = L: IndexError at set time
    "qwen2": [[-1, 1, 2], None],
}


def _slots(aux, hs, hidden):
    return [[k for k, h in enumerate(hs) if torch.allclose(c, h, atol=1e-4, rtol=1e-4)]
            for c in aux.split(hidden, dim=-1)]


def worker(ctx, archs):
    from tpprobe.engines.sglang.tiny import build_target
    from tpprobe.engines.sglang.tiny_weights import hf_reference

    out = {}
    for arch, id_sets in archs.items():
        t = build_target(ctx, arch, L, TOKENS, SEED, torch.float32, None)
        _, hs, logits = hf_reference(arch, L, TOKENS, SEED, prenorm_last=True)
        results = []
        for ids in id_sets:
            for layer in t.model.model.layers:        # flags from an earlier id set (Qwen-MoE)
                layer.__dict__.pop("_is_layer_to_capture", None)
            try:
                t.model.set_eagle3_layers_to_capture(ids)
                res = t.forward()
            except Exception as e:  # noqa: BLE001 - the crash the table predicts
                results.append({"ids": ids, "error": f"{type(e).__name__}: {e}"})
                continue
            aux = t.packed_aux(res)
            results.append({"ids": ids, "logit_diff": (res.next_token_logits - logits[-1]).abs().max().item(),
                            "slots": None if aux is None else _slots(aux, hs, t.hidden_size)})
        # a plain Tap, as a user's own hook would attach it: SGLang's layers return an OwedOutput,
        # which is never read as a tensor; the stream comes from SGLang's boundaries and every
        # reduce is audited once at GroupCoordinator level
        from tpprobe.capture.hooks import Tap

        t.model.set_eagle3_layers_to_capture(None)
        with torch.no_grad(), Tap(t.model) as tap:
            t.forward()
        streams = [torch.allclose(tap.captures[f"layer.{k}.out"], hs[k + 1], atol=1e-4) for k in range(L)]
        out[arch] = {"info": t.info, "results": results, "tap_streams": streams,
                     "tap_audit": [(a.where, a.group, a.group_size, a.source) for a in tap.allreduces
                                   if a.kind == "all_reduce"]}
    return out


def _check(per_rank, archs):
    for res in per_rank:
        for arch, id_sets in archs.items():
            for ids, r in zip(id_sets, res[arch]["results"]):
                p = plan(arch, ids, L)
                if p.crash:
                    assert "error" in r, f"{arch} ids {ids}: table says crash ({p.crash}), forward ran"
                    continue
                assert "error" not in r, f"{arch} ids {ids}: table says ok, forward raised {r['error']}"
                assert r["logit_diff"] < 1e-4, (arch, r["logit_diff"])
                assert r["slots"] == [[k] for k in p.slot_hf_indices], (arch, ids, r["slots"])


def _check_tap(per_rank, archs):
    for res in per_rank:
        for arch in archs:
            assert res[arch]["tap_streams"] == [True] * L, arch
            audit = res[arch]["tap_audit"]
            assert len(audit) == 2 * L + 1 and audit[0][0] == "embed", (arch, audit)   # once each
            assert {(g, n) for _, g, n, _ in audit} == {("tp:0", 2)}
            assert [w for w, _, _, _ in audit[1:]] == [f"layer.{k}" for k in range(L) for _ in (0, 1)]
            assert all(src for _, _, _, src in audit[1:]), audit     # the producer is named


def test_qwen3_and_qwen3_moe_tp2_captures_match_hf_and_derived_rule():
    archs = {k: IDS[k] for k in ("qwen3", "qwen3_moe")}
    per_rank = run_ranks(f"{__name__}:worker", 2, dict(archs=archs), timeout=300)
    _check(per_rank, archs)
    _check_tap(per_rank, archs)
    assert "Qwen3MoeSparseMoeBlock" in per_rank[0]["qwen3_moe"]["info"]["mlp per layer"]


@pytest.mark.sweep
def test_qwen2_tp2_captures_match_hf_and_derived_rule():
    archs = {"qwen2": IDS["qwen2"]}
    per_rank = run_ranks(f"{__name__}:worker", 2, dict(archs=archs), timeout=300)
    _check(per_rank, archs)
    _check_tap(per_rank, archs)
