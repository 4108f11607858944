"""`tpprobe layers --engine vllm` and one draft against both engines (catalogue F26).

vLLM's rule is vLLM 0.32.0's code, tabulated (tpprobe/engines/vllm/rules_table.py): the main venv
(no vLLM) answers from it. In the vLLM tier (`-m vllm`, .venv-vllm) the table is regenerated from the
installed vLLM's code and must equal the shipped file, and the replay of the runners' config readers
must equal vLLM's own functions on every draft-config shape of a grid.

CLI cases are forked from this interpreter (tests.ranks.test_cli_usage._fork_cli), as in test_layers_rules.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks.test_cli_usage import _fork_cli

ROOT = Path(__file__).resolve().parents[3]


def _cli(tmp_path, *args):
    r = _fork_cli(list(args), tmp_path)
    return r.returncode, r.stdout, r.stderr


def _write(d: Path, name: str, cfg: dict) -> str:
    p = d / name
    p.write_text(json.dumps(cfg))
    return str(p)


def test_vllm_rule_json_has_the_sglang_tables_shape(tmp_path):
    rc, out, err = _cli(tmp_path, "layers", "--engine", "vllm", "--arch", "llama", "--ids", "1,3,7",
                        "--num-layers", "8", "--json")
    d = json.loads(out)
    assert rc == 0 and d["class"] == "LlamaForCausalLM" and "tabulated" in d["source"], (out, err)
    assert [(r["requested"], r["slot"], r["hf_index"]) for r in d["rows"]] == [(1, 0, 1), (3, 1, 3), (7, 2, 7)]
    assert d["slots"] == [1, 3, 7] and d["problems"] == [] and "ids as written" in d["rule"]
    # the same ids on SGLang's Llama: +1 always, so id 7 (= L-1) maps to 8, past the loop: dropped
    rc, out, _ = _cli(tmp_path, "layers", "--arch", "llama", "--ids", "1,3,7", "--num-layers", "8", "--json")
    s = json.loads(out)
    assert rc == 1 and set(s) == set(d) and s["slots"] == [2, 4]


@pytest.mark.parametrize("arch,ids,L,slots,problems", [
    ("DeepseekV3ForCausalLM", None, 61, [2, 30, 58], []),              # default (2, N//2, N-3), as written
    ("deepseek_v3", [1, 29, 61], 61, [1, 29, 61], []),                  # id N: after the loop (PR #46973's fix)
    ("qwen3_moe", [8, 1, 4], 8, [1, 4, 8], []),                         # slots in ascending id; N via i+1
    ("llama", [-1, 2, 2, 9], 8, [2],
     ["id -1: dropped", "id 2: duplicate, its stream captured once, in aux slot 0", "id 9: dropped"]),
    ("MiniMaxM2ForCausalLM", [0, 31, 61], 62, [0, 31, 61], []),         # 0 = the embedding
])
def test_vllm_rule_per_architecture(arch, ids, L, slots, problems):
    from tpprobe.engines.vllm.layer_ids import plan

    p = plan(arch, ids, L)
    assert p.slot_hf_indices == slots and p.problems == problems, (p.slot_hf_indices, p.problems)


def test_vllm_rule_bad_input_is_one_line(tmp_path):
    rc, out, err = _cli(tmp_path, "layers", "--engine", "vllm", "--arch", "gpt9")
    assert rc == 2 and "unknown vLLM arch 'gpt9'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = _cli(tmp_path, "layers", "--engine", "tensorrt")
    assert rc == 2 and "--engine 'tensorrt': use sglang or vllm" in err
    rc, out, _ = _cli(tmp_path, "layers", "--engine", "vllm", "--arch", "all", "--num-layers", "8", "--json")
    rows = json.loads(out)
    assert rc == 0 and len(rows) >= 60 and {"LlamaForCausalLM", "DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM",
                                            "GptOssForCausalLM"} <= {r["arch"] for r in rows}


# ---- F26 from configs alone: real draft config shapes --------------------------------------------------
# An EAGLE-3 draft as SpecForge writes it for a MiniMax-M2 target (vLLM PR #43671's case): the ids in the
# output-of-layer convention (first id 1), at the top level and in eagle_config (vLLM reads the first,
# SGLang the second).
SPECFORGE_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 3072,
                   "num_hidden_layers": 1, "draft_vocab_size": 32000, "target_hidden_size": 3072,
                   "eagle_aux_hidden_state_layer_ids": [1, 30, 58],
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 30, 58], "use_aux_hidden_state": True}}
MINIMAX_TARGET = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "num_hidden_layers": 62,
                  "hidden_size": 3072}
DEEPSEEK_TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
                   "hidden_size": 7168}


def test_both_engines_one_layer_apart_from_configs_alone(tmp_path):
    d, t = _write(tmp_path, "draft.json", SPECFORGE_DRAFT), _write(tmp_path, "target.json", MINIMAX_TARGET)
    rc, out, err = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t)
    text = " ".join(out.split())
    assert rc == 1, out + err
    # SGLang's MiniMax adds 1 (the draft gets what it was trained on); vLLM uses the ids as written
    assert "the draft and the target agree on every slot" in text
    verdict = [ln for ln in out.splitlines() if "engine-id-mismatch" in ln]
    assert len(verdict) == 1 and verdict[0].startswith(
        "FAILURE engine-id-mismatch: trained with the output-of-layer ids: on vLLM every slot reads one layer early")
    rc, out, _ = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t, "--json")
    e = json.loads(out)["engines"]
    assert [(r["slot"], r["draft_expects"], r["sglang"], r["vllm"]) for r in e["rows"]] == \
        [(0, 2, 2, 1), (1, 31, 31, 30), (2, 59, 59, 58)]
    assert e["differ"] == [0, 1, 2] and e["finding"] == "engine-id-mismatch" and e["vllm_ids"] == [1, 30, 58]


def test_both_engines_agree_and_model_runners_read_differently(tmp_path):
    # capture-before ids whose first is not 1: DeepSeek on SGLang uses them as given, vLLM as written
    draft = {**SPECFORGE_DRAFT, "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    d, t = _write(tmp_path, "draft.json", draft), _write(tmp_path, "target.json", DEEPSEEK_TARGET)
    rc, out, err = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t, "--draft-convention", "before")
    assert rc == 0 and "SGLang and vLLM capture the same stream at every slot" in out, out + err
    assert "engine-id-mismatch" not in out
    # id 0 is the embedding on SGLang's DeepSeek; vLLM's DeepseekV2Model raises on it (its residual is None before
    # layer 0): slot 0 differs, with the reason
    draft0 = {**SPECFORGE_DRAFT, "eagle_aux_hidden_state_layer_ids": [0, 30, 58],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 30, 58]}}
    d0 = _write(tmp_path, "draft0.json", draft0)
    rc, out, err = _cli(tmp_path, "layers", "--draft-config", d0, "--target-config", t, "--draft-convention", "before",
                        "--json")
    e = json.loads(out)["engines"]
    assert rc == 1 and [(r["sglang"], r["vllm"]) for r in e["rows"]] == [(0, None), (30, 30), (58, 58)], e
    assert any("before layer 0, where its residual is still None: TypeError at the first forward" in n
               for n in e["notes"]), e["notes"]
    # the verdict names the crash, not a different reading of the config
    assert e["verdict"] == ("vLLM cannot serve this draft's ids: DeepseekV2Model.forward "
                            "(vllm/model_executor/models/deepseek_v2.py:1508) captures hidden_states + residual before "
                            "layer 0, where its residual is still None: TypeError at the first forward; every other "
                            "slot is the same stream on both"), e["verdict"]
    # nested ids only (no top-level copy): vLLM's V1 runner reads them, Model Runner V2 does not (its default)
    nested = {k: v for k, v in SPECFORGE_DRAFT.items() if k != "eagle_aux_hidden_state_layer_ids"}
    d = _write(tmp_path, "nested.json", nested)
    rc, out, _ = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t, "--json")
    e = json.loads(out)["engines"]
    assert e["vllm_ids"] is None and e["vllm_runner"] == "v2" and "v1 model runner reads other ids: [1, 30, 58]" \
        in e["notes"][0]
    rc, out, _ = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t, "--json", "--vllm-runner", "v1")
    e = json.loads(out)["engines"]
    assert rc == 1 and [r["vllm"] for r in e["rows"]] == [1, 30, 58] and [r["sglang"] for r in e["rows"]] == [2, 31, 59]
    assert e["verdict"].startswith("trained with the output-of-layer ids: on vLLM every slot reads one layer early")


def test_both_engines_bad_files(tmp_path):
    t = _write(tmp_path, "target.json", DEEPSEEK_TARGET)
    (tmp_path / "bad.json").write_text("{not json")
    rc, _, err = _cli(tmp_path, "layers", "--draft-config", str(tmp_path / "bad.json"), "--target-config", t)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot read a JSON config" in err
    d = _write(tmp_path, "draft.json", SPECFORGE_DRAFT)
    rc, _, err = _cli(tmp_path, "layers", "--draft-config", d, "--target-config", t, "--vllm-runner", "v3")
    assert rc == 2 and "--vllm-runner 'v3': use v1 or v2" in err and "Traceback" not in err


# ---- the vLLM tier: the table is the installed vLLM's code ---------------------------------------------------
@pytest.fixture(scope="module")
def live():
    from tpprobe.engines.vllm import installed_version, rules, rules_table

    if installed_version() != rules_table.VLLM_VERSION:
        pytest.fail(f"the table is vLLM {rules_table.VLLM_VERSION}'s; the installed vLLM is {installed_version()}")
    return rules, rules.tabulate()


@pytest.mark.vllm
def test_the_shipped_table_is_the_installed_vllms(live):
    rules, tab = live
    assert rules.render_table(tab) == (ROOT / rules.TABLE_MODULE).read_text(), \
        "regenerate: .venv-vllm/bin/python -m tpprobe.engines.vllm.rules --write"
    assert len(tab["CLASSES"]) >= 60
    kinds = {e["kind"] for e in tab["CLASSES"].values()}
    assert kinds == {"loop", "hf-recorder"}
    ds = tab["CLASSES"]["DeepseekV3ForCausalLM"]
    assert ds["offers"] == ["before_layer", "end"] and not ds["setter_sorts"]       # its own setter, as given
    assert tab["CLASSES"]["LlamaForCausalLM"]["offers"] == ["start", "after_layer"]
    assert tab["CLASSES"]["Cohere2MoeForCausalLM"]["value"] == "h"                  # appends hidden, no residual


@pytest.mark.vllm
def test_config_readers_replay_vllms_own(live):
    """tpprobe's replay of both model runners' draft-config readers equals vLLM's functions, shape by shape."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tpprobe.engines.vllm.layer_ids import config_ids

    shapes = [{}, {"eagle_aux_hidden_state_layer_ids": [1, 30, 58]},
              {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 30, 58]}},
              {"eagle_aux_hidden_state_layer_ids": [0, 5], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}},
              {"eagle_aux_hidden_state_layer_ids": [], "eagle_config": {"layer_ids": [3, 4]}},
              {"dflash_config": {"target_layer_ids": [1, 5]}},
              {"dflash_config": {"target_layer_ids": [1, 5]}, "eagle_config": {"use_aux_hidden_state": True}},
              {"dspark_target_layer_ids": [2, 6]},
              {"dspark_target_layer_ids": [2, 6], "model_type": "deepseek_v41"},
              {"target_layer_ids": [0, 9]}, {"dflash_config": {"layer_ids": [7]}}]
    for cfg in shapes:
        hf = SimpleNamespace(**cfg)
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
        v2 = get_eagle3_aux_layers_from_config(spec)
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        for runner, want in (("v1", v1), ("v2", v2)):
            got = config_ids(cfg, runner)[0]
            assert (tuple(got) if got else None) == want, (runner, cfg, got, want)



@pytest.mark.vllm
def test_diff_reads_what_vllms_own_writer_writes(tmp_path):
    """vLLM's ExampleHiddenStatesConnector writes the file (its `_write_tensors`, the lock taken as its
    `wait_for_save` takes it; read back by its `load_hidden_states`); tpprobe diff reads it against a tpprobe
    capture of the same tokens: a match on the healthy pair, the exact slot named on an off-by-one."""
    import fcntl
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, load_hidden_states)

    from tests.ranks.test_diff import jdiff
    from tpprobe.eagle3.diff import load_side
    from tpprobe.formats.vllm_hidden import to_tensors

    cap = tmp_path / "cap"
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "1", "--layers", "-1,2,5", "--num-layers",
                        "8", "--quiet", "--out", str(cap)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    s = load_side("baseline", cap)

    def vllm_writes(name, points):
        path = str(tmp_path / "hs" / f"{name}.safetensors")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        ExampleHiddenStatesConnector._write_tensors(to_tensors([s.streams[q] for q in points], s.input_ids),
                                                    SimpleNamespace(synchronize=lambda: None), path, fd)
        back = load_hidden_states(path)
        assert list(back["hidden_states"].shape) == [len(s.input_ids), 3, s.hidden]
        return path

    ok = vllm_writes("req-ok", ["embed.out", "layer.2.out", "layer.5.out"])
    rc, res = jdiff(cap, ok)
    assert rc == 0 and res["kinds"] == ["match"] and res["target"]["kind"] == "vllm-extract", res["verdict"]
    early = vllm_writes("req-early", ["embed.out", "layer.2.out", "layer.4.out"])
    rc, res = jdiff(early, cap)
    assert rc == 1 and res["kinds"] == ["off-by-one"] and res["match"] == [0, 1, None], res["verdict"]
    assert "target slot 2 has no match: layer 5's output was captured where layer 4's output (baseline slot 2) was " \
           "expected, one layer late (off by one)" in res["verdict"]
