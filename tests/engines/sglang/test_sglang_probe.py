"""`tpprobe probe --engine sglang` end to end through the real CLI (ranks started by torch's
elastic launcher): SGLang's own tiny Llama and DeepSeek-V2 (MLA + MoE) are healthy with zero
failure findings, every layer's captured stream equals HF's hidden_states[K+1], the all-reduce
audit attributes every reduce to the layer that owes it, and a skipped embedding reduce in
SGLang's real VocabParallelEmbedding is named partial-allreduce at the embedding.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
L, TOKENS, SEED = 4, 7, 0


def probe(out, *args, nproc=2, pythonpath=None, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", str(nproc), "--out", str(out),
                        "--num-layers", str(L), "--tokens", str(TOKENS), "--seed", str(SEED), "--json",
                        "--timeout", "120", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=timeout)
    assert p.returncode in (0, 1), f"exit {p.returncode}\n{p.stderr[-4000:]}"
    # SGLang's own noise stays out of the user's terminal: no shared memory leaked at exit (the TP
    # group's MessageQueue ring buffer is released), no CPU-only warnings
    for noise in ("leaked shared_memory", "resource_tracker", "Cannot detect CUDA architecture", "is deprecated"):
        assert noise not in p.stderr, (noise, p.stderr[-2000:])
    start = p.stdout.index("{")
    return p.returncode, json.loads(p.stdout[start:]), p


def failures(rep):
    return [f for f in rep["findings"] if f["severity"] == "failure"]


def check_healthy(out, rep, arch, config_path=None):
    from tpprobe.formats.capture_dir import load_run
    from tpprobe.engines.sglang.tiny_weights import hf_reference

    assert failures(rep) == [], rep["findings"]
    assert rep["slots"] and all(s["ok"] for s in rep["slots"]), rep["slots"]
    run = load_run(out)
    assert run.problems == []
    _, hs, _ = hf_reference(arch, L, TOKENS, SEED, config_path=config_path, prenorm_last=True)
    for rank, rec in run.records.items():
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4)
        for k in range(L):      # layer.K.out = the stream leaving layer K = HF hidden_states[K+1]
            assert torch.allclose(rec.tensors[f"layer.{k}.out"], hs[k + 1], atol=1e-4), (rank, k)
        # every all-reduce belongs to the embedding or to the layer whose row-parallel output it sums
        # (the audit also sees the logits all-gather after the last layer: not a reduce)
        gathers = [a for a in rec.meta.collectives if a.kind == "all_gather"]
        assert all(a.where == "other" for a in gathers), gathers
        ars = [a for a in rec.meta.collectives if a.kind == "all_reduce"]
        assert ars[0].where == "embed" and rec.meta.unreduced_rows == []
        assert [a.where for a in ars[1:]] == [f"layer.{k}" for k in range(L) for _ in (0, 1)]
        assert all(a.source and a.source.startswith(f"model.{a.where.replace('.', 's.', 1)}.")
                   for a in ars[1:]), ars
    return run


def test_cli_llama_tp2_healthy_and_equal_to_hf(tmp_path):
    code, rep, _ = probe(tmp_path, "--engine", "sglang", "--arch", "llama", "--layers", "-1,0,2")
    assert code == 0
    check_healthy(tmp_path, rep, "llama")
    assert [s["expected"] for s in rep["slots"]] == ["embed.out", "layer.0.out", "layer.2.out"]


def test_cli_deepseek_v2_mla_moe_tp2_healthy_and_equal_to_hf(tmp_path):
    # DeepSeek: no +1 unless the first id is 1, so id k captures the stream entering layer k
    code, rep, _ = probe(tmp_path, "--engine", "sglang", "--arch", "deepseek_v2", "--layers", "0,1,3")
    assert code == 0
    run = check_healthy(tmp_path, rep, "deepseek_v2")
    assert [s["expected"] for s in rep["slots"]] == ["embed.out", "layer.0.out", "layer.2.out"]
    assert "DeepseekV2MoE" in rep["settings"]["mlp per layer"]
    moe = [a.source for a in run.records[0].meta.collectives if (a.source or "").endswith(".mlp")]
    assert moe == [f"model.layers.{k}.mlp" for k in range(1, L)]   # the MoE block's own reduce


# CI builds SGLang's models from a --config at tp 2 (tests/ranks/test_accept.py, test_model_shapes.py)
@pytest.mark.sweep
def test_cli_llama_tp4_from_config_file(tmp_path):
    from tpprobe.engines.sglang.tiny_archs import tiny_config

    d = tiny_config("llama", 32).to_dict()
    d["quantization_config"] = {"quant_method": "fp8"}   # dropped: random weights in probe dtype
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(d))
    out = tmp_path / "run"
    code, rep, _ = probe(out, "--engine", "sglang", "--config", str(cfg), "--layers", "1,2", nproc=4)
    assert code == 0
    check_healthy(out, rep, "llama", config_path=str(cfg))
    assert rep["settings"]["world_size"] == 4 and "config " in rep["settings"]["model"]


def test_cli_skipped_embedding_reduce_is_partial_allreduce(tmp_path):
    code, rep, _ = probe(tmp_path, "--model", "sglang_faults:llama_skip_embed_reduce", "--layers", "-1,0,2",
                         pythonpath=os.path.join(ROOT, "examples"))
    assert code == 1
    f = failures(rep)
    assert [x["kind"] for x in f] == ["partial-allreduce"], rep["findings"]
    assert f[0]["where"].startswith("embedding") and "embed_tokens" in f[0]["where"]
