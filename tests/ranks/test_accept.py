"""`tpprobe accept`: the EAGLE-3 draft replayed on two feature sets.

Start at `test_each_aux_fault_collapses_acceptance_and_slot_order_recovers_with_fix`: a small
draft head is trained (examples/accept_toy_draft.py), in seconds, on the built-in model's healthy aux
features (real 2-rank
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

from examples.accept_toy_draft import IDS, TOKENS, V, capture as _capture, probe_args, train as _train
from tests.helpers.ranks import ROOT, probe, run_cli
from tpprobe.eagle3.accept.score import accept_lengths, run_accept
FAULTS = {  # --inject -> catalogue row (faults of the built-in model that change the aux input)
    "slice-capture": "F6", "capture-offset": "F7", "slot-order": "F8", "drop-embed-slot": "F8",
    "alias-capture": "F9", "embed-after-norm": "F13",
}


def _probe_together(base: Path, runs: dict, timeout: float = 600) -> dict:
    """Start every probe at once (`tpprobe probe --nproc 2 --out base/NAME ARGS`), wait for all; returns
    {name: (exit code, report.json, stderr)}. One launch each, in parallel: the lean way to get
    several captures."""
    import os
    import signal
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = {name: subprocess.Popen([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--out",
                                     str(base / name), "--quiet", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True)
             for name, args in runs.items()}
    out = {}
    for name, p in procs.items():
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            raise AssertionError(f"probe {name} did not finish in {timeout}s")
        rep = base / name / "report.json"
        out[name] = (p.returncode, json.loads(rep.read_text()) if rep.exists() else {}, err)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accept")
    common = [*probe_args(), "--timeout", "240"]     # embedding rows at a trained model's scale (--embed-std)
    res = _probe_together(base, {name: common + ([] if name == "healthy" else ["--inject", name])
                                 for name in ["healthy", *FAULTS]})
    out = {}
    for name, (code, _, err) in res.items():
        assert code == (0 if name == "healthy" else 1), (name, err[-2000:])
        out[name] = base / name
    feats, ids = _capture(out["healthy"])
    out["draft"] = _train(feats, ids, base / "draft")
    return out


def test_accept_lengths_count_the_leading_accepted_run():
    a = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    got = accept_lengths(a, ks=(1, 2, 3))         # every k over the starts 0..3, where a chain of 3 fits
    assert got[1] == pytest.approx((1 + 1 + 0 + 1) / 4)
    assert got[2] == pytest.approx((2 + 1 + 0 + 2) / 4)
    assert got[3] == pytest.approx((2 + 1 + 0 + 3) / 4)


def test_a_longer_chain_never_reads_a_shorter_accept_length():
    """Averaged over the starts where each chain fits, k=2 read 0.8 and k=3 0.75 here (the last start, which
    only k=2 counts, is accepted): every k is averaged over the same starts, so the table never falls with k."""
    got = accept_lengths(torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool), ks=(1, 2, 3))
    assert got == {1: 0.25, 2: 0.5, 3: 0.75}
    assert accept_lengths(torch.tensor([1, 0], dtype=torch.bool), ks=(1, 2, 3)) == {1: None, 2: None, 3: None}


def _short_run(tmp_path, tokens: int):
    """A hand-built draft (tests/zoo/drafts.py) and a SpecForge sample of `tokens` tokens it reads exactly."""
    from tests.zoo.drafts import hand_draft, planted_streams
    from tpprobe.formats.specforge import write_sample
    s = planted_streams(6, tokens=tokens)
    draft = hand_draft(s, [0, 2, 4], tmp_path / "draft", [-1, 1, 3])
    good = write_sample(tmp_path / "good.ckpt", s.input_ids, s.packed([0, 2, 4]))
    swapped = write_sample(tmp_path / "swapped.ckpt", s.input_ids, s.packed([2, 0, 4]))
    return draft, good, swapped


def test_a_sequence_no_chain_of_5_fits_is_one_line_exit_2(tmp_path):
    draft, good, _ = _short_run(tmp_path, 6)
    cp = run_cli(["accept", "--draft", str(draft), "--baseline", str(good), "--target", str(good), "--engine",
                  "torch"])
    assert (cp.returncode, cp.stdout) == (2, ""), cp.stdout + cp.stderr
    assert cp.stderr == (f"tpprobe: error: the token sequence from {good} has 6 tokens: a chain of 5 drafted tokens "
                         f"needs at least 7 (features t, tokens t+1 … t+6); capture a longer sequence\n")


def test_the_table_says_what_each_k_averages_over(tmp_path):
    draft, good, swapped = _short_run(tmp_path, 40)
    cp = run_cli(["accept", "--draft", str(draft), "--baseline", str(good), "--target", str(swapped), "--engine",
                  "torch", "--json"])
    rep = json.loads(cp.stdout)
    assert rep["chain_starts"] == 34 and "every k averaged over the same starts t" in rep["estimate"]
    for row in rep["rows"]:
        lengths = [row["accept_length"][str(k)] for k in rep["chain_lengths"]]
        assert lengths == sorted(lengths), row
    assert [rep["rows"][0]["accept_length"][str(k)] for k in rep["chain_lengths"]] == [2.0, 3.0, 4.0, 5.0, 6.0]
    cp = run_cli(["accept", "--draft", str(draft), "--baseline", str(good), "--target", str(swapped), "--engine",
                  "torch"])
    assert ("expected accept length for a chain of k drafted tokens (1 + accepted drafts), every k over the same 34 "
            "start positions (those where a chain of 5 fits)") in " ".join(cp.stdout.split()), cp.stdout


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
        costs[inj] = (round(rep["cost"], 2), tgt["top1_agreement"] and round(tgt["top1_agreement"], 3))
        # every fault costs more than one accept length of the chain of 5; F13 too, since the
        # embedding rows are at a trained model's scale (--embed-std 0.01: the norm rescales slot 0 ~100x)
        assert rep["exit_code"] == 1, (inj, rep["line"])
        assert tgt["accept_length"]["5"] < base["accept_length"]["5"] - 1.0, (inj, row, rep["line"])
        if inj == "slot-order":          # a permutation explains it: --fix recovers all of it
            assert rep["fix"]["explained"] and rep["rows"][2]["accept_length"] == base["accept_length"], rep["line"]
            # the re-ordering says what each moved slot then holds (the slot-order fault swaps slots 0 and 1)
            how = ("slot 0 ← target slot 1 (slot 0 then holds the embedding, as the baseline's slot 0 does), slot 1 "
                   "← target slot 0 (slot 1 then holds layer 1's output, as the baseline's slot 1 does)")
            assert rep["fix"]["how"] == how, rep["fix"]["how"]
            assert f"; with slots re-ordered as the matcher proposes ({how}), 0.00 remains" in rep["line"], rep["line"]
        elif inj == "slice-capture":
            assert not tgt["usable"] and "TP-sliced" in tgt["why"], tgt
            assert tgt["accept_length"]["5"] == 1.0          # no draft token accepted: the target's own
            assert rep["cost"] == pytest.approx(base["accept_length"]["5"] - 1.0), rep["line"]
        else:
            assert not rep["fix"]["explained"] and "does not explain it" in rep["line"], (inj, rep["line"])
    print("healthy accept length (chain of 5):", base["accept_length"]["5"], "top-1", base["top1_agreement"])
    print("accept-length cost, top-1 per fault:", json.dumps(costs))


def test_the_cli_scores_the_seeds_slot_order_with_sglangs_draft_and_writes_json_and_markdown(runs, tmp_path):
    md = tmp_path / "accept.md"
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["slot-order"]), "--fix", "--json", "--markdown", str(md)], timeout=240)
    assert cp.returncode == 1, cp.stderr[-2000:]
    rep = json.loads(cp.stdout)
    assert rep["engine"].startswith("sglang ") and "LlamaForCausalLMEagle3" in rep["engine"]
    assert rep["device"] == "cpu" and "device_name" not in rep      # --device auto on a machine without CUDA
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
        "from tpprobe.eagle3.accept.draft import load_draft;"
        "from tpprobe.eagle3.accept.engines import Eagle3Forward;"
        "from tpprobe.engines.sglang.eagle3_draft import SGLangEagle3;"
        "from examples.accept_toy_draft import capture as _capture; from pathlib import Path;"
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
    ("small-vocab", "outside the draft's vocabulary [0, 4)"),
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
    if break_it == "small-vocab":     # a draft of another model: the sequence's ids do not fit its vocabulary
        w.pop("d2t")
        cfg["vocab_size"] = cfg["draft_vocab_size"] = 4
    save_file(w, str(bad / "model.safetensors"))
    if break_it != "config":
        (bad / "config.json").write_text(json.dumps(cfg))
    cp = run_cli(["accept", "--draft", str(bad), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["healthy"]), "--engine", "torch"])
    assert cp.returncode == 2 and message in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr


def test_sources_of_other_tokens_are_refused(runs, tmp_path):
    other = tmp_path / "other"
    code, _, cp = probe(other, *probe_args(), "--seed", "3")
    assert code == 0, cp.stderr[-1000:]
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(other), "--engine", "torch"])
    assert cp.returncode == 2 and "captured on other tokens" in cp.stderr, cp.stderr


# ---- F16 and F18: serving faults on SGLang's own tiny Llama -------
SGLANG_FAULTS = {"fused-allreduce-capture": "F16", "capture-no-residual": "F18"}


@pytest.fixture(scope="module")
def sglang_runs(tmp_path_factory):
    """Three probes of SGLang's LlamaForCausalLM (tp 2, gloo), started together: healthy, F16, F18.
    The config is the tiny Llama's with vocab 8, so the draft must read the aux features."""
    pytest.importorskip("sglang")
    base = tmp_path_factory.mktemp("accept-sglang")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    (base / "config.json").write_text(json.dumps(cfg))
    common = ["--engine", "sglang", "--config", str(base / "config.json"), "--num-layers", "5",
              "--layers", ",".join(map(str, IDS)), "--tokens", str(TOKENS), "--timeout", "240"]
    res = _probe_together(base, {name: common + ([] if name == "healthy" else ["--inject", name])
                                 for name in ["healthy", *SGLANG_FAULTS]})
    out = {}
    want = {"healthy": [], "fused-allreduce-capture": [("partial-capture", "aux slot 1")],
            "capture-no-residual": [("capture-no-residual", "aux slot 1")]}
    for name, (code, rep, err) in res.items():
        kinds = [(f["kind"], f["where"]) for f in rep.get("findings", []) if f["severity"] == "failure"]
        assert code == (0 if name == "healthy" else 1) and kinds == want[name], (name, kinds, err[-2000:])
        out[name] = base / name
    feats, ids = _capture(out["healthy"])
    assert ids.max() < V and feats.shape[-1] == 3 * 64
    out["draft"] = _train(feats, ids, base / "draft")
    return out


@pytest.mark.sglang     # three SGLang probes started together and a draft: ~30 s of CI
def test_serving_faults_f16_f18_on_sglangs_llama_cost_accept_length(sglang_runs):
    costs = {}
    base = None
    for inj in SGLANG_FAULTS:
        rep = run_accept(sglang_runs["draft"], sglang_runs["healthy"], sglang_runs[inj], engine="torch", fix=True)
        base, tgt = rep["rows"][0], rep["rows"][1]
        costs[SGLANG_FAULTS[inj]] = (round(rep["cost"], 2), round(tgt["top1_agreement"], 3))
        assert base["top1_agreement"] > 0.95 and base["accept_length"]["5"] > 5.0, base
        assert tgt["usable"] and rep["exit_code"] == 1, (inj, rep["line"])
        assert not rep["fix"]["explained"] and "does not explain it" in rep["line"], (inj, rep["line"])
        costs[SGLANG_FAULTS[inj]] += (rep["line"],)
    print("accept-length cost on SGLang's Llama:", json.dumps(costs, indent=1))
    # measured (docs/accept.md): F16 1.63 (6.00 -> 4.37, top-1 87 %), F18 4.45 (6.00 -> 1.55, top-1 36 %)
    assert costs["F16"][0] > 1.0 and costs["F18"][0] > 3.0, costs


def test_bad_sources_are_refused_with_what_to_do(runs, tmp_path):
    """In process (the CLI turns these errors into one line and exit 2, as
    test_a_bad_draft_is_one_line_and_exit_2 shows)."""
    from safetensors.torch import save_file
    from tpprobe.core.errors import TPProbeError
    feats, _ = _capture(runs["healthy"])
    bare, short = tmp_path / "bare.safetensors", tmp_path / "short.safetensors"   # features without token ids
    save_file({"aux": feats.contiguous()}, str(bare))
    save_file({"aux": feats[:-1].contiguous()}, str(short))
    d, h = runs["draft"], runs["healthy"]
    for kw, message in [
        (dict(baseline=h, target=h, tokens_from=bare), "holds no input_ids; pass a capture folder"),
        (dict(baseline=h, target=short), "has 191 token rows, the token sequence from"),
        (dict(baseline=tmp_path / "nowhere", target=h), "no such file or folder"),
    ]:
        with pytest.raises(TPProbeError, match=message) as e:
            run_accept(d, engine="torch", **kw)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_a_source_of_another_length_is_one_line_and_exit_2_from_the_cli(runs, tmp_path):
    """Mismatched token counts through the real CLI: one line, exit 2."""
    from safetensors.torch import save_file
    feats, _ = _capture(runs["healthy"])
    short = tmp_path / "short.safetensors"
    save_file({"aux": feats[:-1].contiguous()}, str(short))
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(short), "--engine", "torch"])
    assert cp.returncode == 2 and f"has {TOKENS - 1} token rows, the token sequence from" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr and not cp.stdout.strip()


# ---- --device: the torch engine on a GPU; --tolerance ---------------
@pytest.mark.parametrize("args, message", [
    (["--engine", "sglang", "--device", "cuda"], "SGLang's class runs on CPU in this tool; use --engine torch on GPU"),
    (["--device", "tpu"], "--device 'tpu': use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "torch sees no CUDA device here" if not torch.cuda.is_available()
     else "pick one of those"),
    (["--tolerance", "-1"], "--tolerance -1: give an accept-length difference >= 0 (default 0.05)"),
])
def test_a_device_the_draft_cannot_run_on_or_a_negative_tolerance_is_one_line_and_exit_2(runs, args, message):
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["healthy"]), *args])
    assert cp.returncode == 2 and message in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr and not cp.stdout.strip()


@pytest.mark.gpu
def test_the_draft_on_cuda_agrees_with_cpu_position_by_position(runs):
    """The same accept (torch engine, float32, TF32 off) on cuda and on cpu over the trained draft:
    healthy, and F8 slot-order with --fix (rows at ~100 % and ~32 % agreement). Bound on flips:
    the two devices' float32 logits differ by rounding (~1e-6 of their scale: other summation
    orders, TF32 off), so a position's top-1 can differ only where the CPU logits' top-2 margin is
    that small. Every differing position must be such a near-tie (margin < 1e-4 of the logits'
    scale, a hundredfold room over rounding), and at most 2 of the 190 per row (a wrong device
    path flips tens). Accept lengths within 0.05."""
    import math
    from tpprobe.eagle3.accept.draft import load_draft
    from tpprobe.eagle3.accept.engines import Eagle3Forward
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA (run with -m gpu on the GPU machine)")
    d = load_draft(runs["draft"])
    eng = Eagle3Forward(d)

    def margins(run):            # the CPU logits' top-2 margin at each position, over their scale
        feats, ids = _capture(run)
        with torch.no_grad():
            lg = eng.logits(feats[:-1], ids[1:])
        top2 = lg.topk(2, dim=-1).values
        return ((top2[:, 0] - top2[:, 1]) / lg.abs().max()).tolist()

    for target in ("healthy", "slot-order"):
        cpu = run_accept(runs["draft"], runs["healthy"], runs[target], engine="torch", fix=True, device="cpu")
        gpu = run_accept(runs["draft"], runs["healthy"], runs[target], engine="torch", fix=True, device="cuda")
        assert cpu["device"] == "cpu" and gpu["device"] == "cuda:0" and gpu["engine"].startswith("torch")
        # the rows' features: the baseline's, the target's, and (fixed) the target re-ordered = the baseline's
        marg = [margins(runs["healthy"]), margins(runs[target]), margins(runs["healthy"])]
        for rc, rg, m in zip(cpu["rows"], gpu["rows"], marg):
            flips = [t for t, (a, b) in enumerate(zip(rc["per_position"], rg["per_position"], strict=True)) if a != b]
            assert len(flips) <= 2 and all(m[t] < 1e-4 for t in flips), (target, rc["label"], flips,
                                                                          [m[t] for t in flips])
            for k in rc["accept_length"]:
                assert math.isclose(rc["accept_length"][k], rg["accept_length"][k], abs_tol=0.05), (target, k)
        assert len(cpu["rows"]) == len(gpu["rows"]) == 3 and gpu["exit_code"] == cpu["exit_code"]
    # the CLI with the default engine on cuda: the torch engine, said in the JSON and the header
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["slot-order"]), "--fix", "--device", "cuda", "--json"], timeout=240)
    rep = json.loads(cp.stdout)
    assert cp.returncode == 1 and rep["device"] == "cuda:0" and rep["engine"].startswith("torch ("), cp.stderr[-2000:]
    assert "SGLang's class runs on CPU in this tool" in rep["engine"] and rep["device_name"]
    assert rep["rows"][2]["accept_length"] == rep["rows"][0]["accept_length"] and "0.00 remains" in rep["line"]
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                  "--target", str(runs["slot-order"]), "--device", "cuda:0"], timeout=240)
    # the header, however wrapped
    assert cp.returncode == 1 and " on cuda:0 (" in " ".join(cp.stdout.split()), cp.stdout[-2000:]


def test_the_cli_writes_html_and_markdown_like_every_command(runs, tmp_path):
    from tests.ranks.test_sinks import assert_written
    cp = run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]), "--engine", "torch",
                  "--target", str(runs["slot-order"]), "--html", str(tmp_path / "a.html"),
                  "--markdown", str(tmp_path / "a.md")], timeout=240)
    assert cp.returncode == 1, cp.stderr[-2000:]
    assert f"HTML report: {tmp_path / 'a.html'}" in cp.stdout
    rep = json.loads(run_cli(["accept", "--draft", str(runs["draft"]), "--baseline", str(runs["healthy"]),
                              "--engine", "torch", "--target", str(runs["slot-order"]), "--json"], timeout=240).stdout)
    rows = [[r["label"], f"{r['top1_agreement']:.1%}", f"{r['accept_length']['5']:.2f}"] for r in rep["rows"]]
    assert_written(tmp_path, "a", f"COST: {rep['line']}", rows)
