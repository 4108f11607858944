"""`tpprobe accept`: the EAGLE-3 draft replayed on two feature sets (issue 22).

Start at `test_each_aux_fault_collapses_acceptance_and_slot_order_recovers_with_fix`: a small
draft head is trained here, in seconds, on the built-in model's healthy aux features (real 2-rank
gloo probe runs), saved as SpecForge saves a draft, and scored by the real CLI against captures of
each catalogue fault that changes the aux input. `test_reimplementation_matches_sglangs_class`
proves the torch engine equals SGLang's own LlamaForCausalLMEagle3 on the same weights.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ranks import ROOT, probe, run_cli
from tpprobe.tools.accept import (KS, Draft, Eagle3Forward, accept_lengths, load_draft, run_accept,
                                  write_draft)

TOKENS = 192
IDS = [-1, 1, 3]
H, V = 64, 8      # vocab 8: no token alone names its position, so the draft needs every slot's context
FAULTS = {  # --inject -> catalogue row (faults of the built-in model that change the aux input)
    "slice-capture": "F6", "capture-offset": "F7", "slot-order": "F8", "drop-embed-slot": "F8",
    "alias-capture": "F9", "embed-after-norm": "F13",
}


def _config(draft_vocab=None):
    draft_vocab = draft_vocab or V
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4,
            "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
            "target_hidden_size": H, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS}}


def _init_weights(seed=0, draft_vocab=None):
    draft_vocab = draft_vocab or V
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=None):
        return torch.randn(*s, generator=g) * (scale if scale is not None else s[-1] ** -0.5)
    L = "layers.0."
    return {"fc.weight": r(H, 3 * H), "embed_tokens.weight": torch.zeros(V, H),
            L + "self_attn.q_proj.weight": r(H, 2 * H), L + "self_attn.k_proj.weight": r(H // 2, 2 * H),
            L + "self_attn.v_proj.weight": r(H // 2, 2 * H), L + "self_attn.o_proj.weight": r(H, H),
            L + "mlp.gate_proj.weight": r(128, H), L + "mlp.up_proj.weight": r(128, H),
            L + "mlp.down_proj.weight": r(H, 128), L + "input_layernorm.weight": torch.ones(H),
            L + "hidden_norm.weight": torch.ones(H), L + "post_attention_layernorm.weight": torch.ones(H),
            "norm.weight": torch.ones(H), "lm_head.weight": r(draft_vocab, H)}


def _capture(run_dir: Path):
    from safetensors.torch import load_file
    t = load_file(str(run_dir / "rank-000.safetensors"))
    return t["aux.packed"], t["input_ids"].to(torch.int64)


def _train(feats, ids, out: Path) -> Path:
    """A draft trained on the healthy features: it learns the sequence's next-next tokens from the aux
    features alone (its token embedding is zero, frozen, so it cannot shortcut through token t+1).
    The draft vocabulary is a permutation of the target's, so d2t must be honoured to score it."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(7))      # draft index -> target id
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(V)
    cfg = _config()
    w = _init_weights()
    d = Draft(path=out, config=cfg, weights=w, hidden=H, target_hidden=H, k=3, layer_ids=IDS, vocab=V,
              draft_vocab=V, heads=8, kv_heads=4, head_dim=8, eps=1e-6, rope_theta=10000.0,
              d2t=perm - torch.arange(V))
    m = Eagle3Forward(d)
    trainable = [p for n, p in m.p.items() if n != "embed_tokens__weight"]     # the embedding is the target's
    opt = torch.optim.Adam(trainable, lr=1e-2)
    T = ids.numel()
    x, nxt, y = feats[: T - 2], ids[1: T - 1], inv[ids[2:]]
    torch.manual_seed(0)
    for step in range(800):
        loss = torch.nn.functional.cross_entropy(m.logits(x, nxt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49 and (m.logits(x, nxt).argmax(-1) == y).float().mean() > 0.98:
            break
    ws = {n.replace("__", "."): p.detach().clone() for n, p in m.p.items()}
    ws["d2t"] = (perm - torch.arange(V)).to(torch.int64)
    ws["t2d"] = torch.ones(V, dtype=torch.bool)
    return write_draft(out, ws, cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accept")
    out = {}
    for name in ["healthy", *FAULTS]:
        args = ["--tokens", str(TOKENS), "--vocab", str(V), "--layers", ",".join(map(str, IDS))]
        if name != "healthy":
            args += ["--inject", name]
        code, rep, cp = probe(base / name, *args)
        assert code == (0 if name == "healthy" else 1), cp.stderr[-2000:]
        out[name] = base / name
    feats, ids = _capture(out["healthy"])
    out["draft"] = _train(feats, ids, base / "draft")
    return out


def test_accept_lengths_count_the_leading_accepted_run():
    a = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    got = accept_lengths(a, ks=(1, 2, 3))
    assert got[1] == pytest.approx(5 / 6)
    assert got[2] == pytest.approx((2 + 1 + 0 + 2 + 2) / 5)
    assert got[3] == pytest.approx((2 + 1 + 0 + 3) / 4)


def test_each_aux_fault_collapses_acceptance_and_slot_order_recovers_with_fix(runs):
    healthy = run_accept(runs["draft"], runs["healthy"], runs["healthy"], engine="torch")
    base = healthy["rows"][0]
    assert healthy["exit_code"] == 0 and healthy["cost"] == 0.0
    assert base["top1_agreement"] > 0.95, base           # trained on these features
    assert base["accept_length"]["5"] > 5.0
    costs = {}
    for inj, row in FAULTS.items():
        rep = run_accept(runs["draft"], runs["healthy"], runs[inj], engine="torch", fix=True)
        tgt = rep["rows"][1]
        costs[inj] = round(rep["cost"], 2)
        if inj == "embed-after-norm":
            # F13 on the built-in model: its embedding rows already have RMS ~1, so the norm moves
            # slot 0 by ~10 % and this draft (which leans on the deeper slots) does not notice; the
            # tool says so rather than inventing a cost (docs/accept.md)
            assert tgt["usable"] and tgt["top1_agreement"] is not None
            assert (rep["exit_code"] == 1) == (rep["cost"] > rep["tolerance"]), rep["line"]
            continue
        assert rep["exit_code"] == 1, (inj, rep["line"])
        assert tgt["accept_length"]["5"] < base["accept_length"]["5"] - 1.0, (inj, row, rep["line"])
        if inj == "slot-order":          # a permutation explains it: --fix recovers all of it
            assert rep["fix"]["explained"] and rep["rows"][2]["accept_length"] == base["accept_length"], rep["line"]
            assert "with slots re-ordered as the matcher proposes" in rep["line"] and "0.00 remains" in rep["line"]
        elif inj == "slice-capture":
            assert not tgt["usable"] and "TP-sliced" in tgt["why"], tgt
            assert tgt["accept_length"]["5"] == 1.0
        else:
            assert not rep["fix"]["explained"] and "does not explain it" in rep["line"], (inj, rep["line"])
    print("accept-length cost per fault:", json.dumps(costs))


def test_the_cli_scores_the_seeds_slot_order_with_sglangs_draft_and_writes_json_and_markdown(runs, tmp_path):
    md = tmp_path / "accept.md"
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["slot-order"]), "--fix", "--json", "--markdown", str(md)], timeout=240)
    assert cp.returncode == 1, cp.stderr[-2000:]
    rep = json.loads(cp.stdout)
    assert rep["engine"].startswith("sglang ") and "LlamaForCausalLMEagle3" in rep["engine"]
    base, tgt, fixed = rep["rows"]
    assert base["top1_agreement"] > 0.95 and tgt["accept_length"]["5"] < base["accept_length"]["5"] - 1.0
    assert fixed["accept_length"] == base["accept_length"]
    assert rep["line"].startswith("the target capture costs ") and "0.00 remains" in rep["line"]
    text = md.read_text()
    assert rep["line"] in text and "| target |" in text


@pytest.mark.sglang
def test_reimplementation_matches_sglangs_class(runs):
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]);"
        "from tpprobe.tools.accept import load_draft, Eagle3Forward, SGLangEagle3;"
        "from tests.test_accept import _capture; from pathlib import Path;"
        "d = load_draft(sys.argv[2]); f, ids = _capture(Path(sys.argv[3]));"
        "a = Eagle3Forward(d).logits(f[:-1], ids[1:]).detach(); b = SGLangEagle3(d).logits(f[:-1], ids[1:]);"
        "print((a - b).abs().max().item(), a.abs().max().item(), bool((a.argmax(-1) == b.argmax(-1)).all()))")
    cp = subprocess.run([sys.executable, "-c", code, str(ROOT), str(runs["draft"]), str(runs["healthy"])],
                        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert cp.returncode == 0, cp.stderr[-3000:]
    diff, scale, same_top1 = cp.stdout.split()[-3:]
    assert float(diff) <= 1e-4 * float(scale) and same_top1 == "True", cp.stdout


@pytest.mark.parametrize("break_it, message", [
    ("fc", "fc.weight is [64, 128] but the config says 3 aux slots"),
    ("vocab", "has no d2t map"),
    ("config", "no config.json there"),
])
def test_a_bad_draft_is_one_line_and_exit_2(runs, tmp_path, break_it, message):
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    w = load_file(str(runs["draft"] / "model.safetensors"))
    cfg = json.loads((runs["draft"] / "config.json").read_text())
    if break_it == "fc":
        w["fc.weight"] = w["fc.weight"][:, :128].contiguous()
    if break_it == "vocab":
        w.pop("d2t")
        cfg["draft_vocab_size"] = 6
        w["lm_head.weight"] = w["lm_head.weight"][:6].contiguous()
    save_file(w, str(bad / "model.safetensors"))
    if break_it != "config":
        (bad / "config.json").write_text(json.dumps(cfg))
    cp = run_cli(["accept", "--draft", str(bad), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["healthy"]), "--engine", "torch"])
    assert cp.returncode == 2 and message in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr


def test_sources_of_other_tokens_are_refused(runs, tmp_path):
    other = tmp_path / "other"
    code, _, cp = probe(other, "--tokens", str(TOKENS), "--vocab", str(V), "--seed", "3", "--layers", "-1,1,3")
    assert code == 0, cp.stderr[-1000:]
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(other), "--engine", "torch"])
    assert cp.returncode == 2 and "captured on other tokens" in cp.stderr, cp.stderr
