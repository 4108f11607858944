"""Real configs as they ship: the hub's Kimi-K2.5 config.json (tests/assets/kimi-k2.5, the wrapper
`KimiK25ForConditionalGeneration` with its DeepSeek-V3 text model under `text_config`) is read wherever a
config is read, and a model too big for the machine is refused before anything starts.

* tpprobe.config.hub reads the wrapper and its text model (61 layers, hidden 7168, 384 experts);
* `probe --engine sglang|vllm --config` at tp 8 is refused in one line within seconds (exit 2): the memory it
  needs, what is available, and the shrink options that keep the TP structure (--num-experts, --vocab-size,
  --num-layers); a config that is no JSON is refused before SGLang is imported;
* the shrink options keep hidden size, heads, MLA ranks and the dense/MoE layer pattern (the HF config built);
* `layers --draft-config --target-config` reads the wrapper: SGLang's rule for KimiK25ForConditionalGeneration,
  vLLM's for its text model DeepseekV3ForCausalLM (the wrapper hands it the ids), never "unknown vLLM arch";
* at real width 7168 the shrunk Kimi-K2.5 runs healthy on CPU gloo at tp 2 (sweep: about 2 minutes, 10 GB).
"""
import json
import time
from pathlib import Path

import pytest

from tests.helpers.ranks import run_cli

KIMI = Path(__file__).resolve().parents[1] / "assets" / "kimi-k2.5" / "config.json"


def one_line(cp) -> str:
    lines = [x for x in cp.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in cp.stderr, cp.stderr[-3000:]
    assert "bug in tpprobe" not in lines[0]
    return lines[0]


def test_the_hub_kimi_config_is_read_through_its_text_model():
    from tpprobe.config.hub import read_config

    hub = read_config(KIMI)
    assert (hub.architecture, hub.wrapper, hub.text_architecture) == \
        ("KimiK25ForConditionalGeneration", "KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert (hub.model_type, hub.num_layers, hub.get("hidden_size"), hub.get("n_routed_experts")) == \
        ("kimi_k2", 61, 7168, 384)
    assert hub.dtype == "bfloat16"
    from tpprobe.engines.sglang.tiny_archs import config_arch_and_layers
    assert config_arch_and_layers(str(KIMI)) == ("deepseek_v2", 61)


@pytest.mark.parametrize("raw,text_arch,L", [
    ({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
      "text_config": {"model_type": "qwen3_vl_text", "num_hidden_layers": 36}}, "Qwen3ForCausalLM", 36),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62}}, "Gemma3ForCausalLM", 62),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
      "hidden_size": 7168}, "DeepseekV3ForCausalLM", 61),
])
def test_other_wrappers_and_plain_configs_name_their_text_model(raw, text_arch, L):
    from tpprobe.config.hub import parse

    hub = parse(raw)
    assert (hub.architecture, hub.text_architecture, hub.num_layers) == (raw["architectures"][0], text_arch, L)
    assert (hub.wrapper is None) == ("text_config" not in raw)


def test_a_wrapper_whose_text_model_the_backend_does_not_build_is_said_before_the_engine(tmp_path):
    from tpprobe.core.errors import UsageError
    from tpprobe.engines.sglang.tiny_archs import config_arch_and_layers

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                               "text_config": {"model_type": "qwen3_vl_text", "num_hidden_layers": 36}}))
    with pytest.raises(UsageError, match="Qwen3VLForConditionalGeneration \\(its text model Qwen3ForCausalLM, under "
                                         "text_config\\) model, text model_type 'qwen3_vl_text'"):
        config_arch_and_layers(str(cfg))


def test_the_shrink_options_keep_the_tp_structure():
    pytest.importorskip("transformers")
    from tpprobe.engines.sglang.tiny_archs import load_config

    c = load_config(None, str(KIMI), 3, num_experts=8, vocab=4096)
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.v_head_dim, c.intermediate_size, c.moe_intermediate_size) == \
        (7168, 64, 1536, 512, 128, 64, 128, 18432, 2048)
    assert (c.num_hidden_layers, c.first_k_dense_replace, c.n_routed_experts, c.vocab_size) == (3, 1, 8, 4096)
    assert c.architectures == ["DeepseekV3ForCausalLM"] and c.num_experts_per_tok == 8


def test_a_config_with_several_leading_dense_layers_keeps_them_in_the_build_and_the_estimate(tmp_path):
    """DeepSeek-V3's own config has 3 dense layers first: the suggested cut (--num-layers 4) builds 3 dense layers
    and 1 MoE layer, and the estimate counts the same (a cut to fewer keeps at least one MoE layer)."""
    pytest.importorskip("transformers")
    from tpprobe.config.hub import read_config
    from tpprobe.engines.footprint import params, suggestion
    from tpprobe.engines.sglang.tiny_archs import load_config

    text = dict(json.loads(KIMI.read_text())["text_config"], model_type="deepseek_v3", first_k_dense_replace=3,
                architectures=["DeepseekV3ForCausalLM"])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(text))
    hub = read_config(cfg)
    assert suggestion(hub, "deepseek_v2", 61, 8)["num_layers"] == 4
    assert [load_config(None, str(cfg), L, num_experts=8, vocab=4096).first_k_dense_replace
            for L in (61, 4, 2, 1)] == [3, 3, 1, 0]
    # against Kimi-K2.5 (the same text model, 1 leading dense layer): layers 1 and 2 are dense here, MoE there
    # (8 routed experts, 1 shared, the router)
    h, ffn, moe_ffn = 7168, 18432, 2048
    assert params(hub, "deepseek_v2", 4, 1, 8, 4096)[0] - params(read_config(KIMI), "deepseek_v2", 4, 1, 8, 4096)[0] \
        == 2 * (3 * h * ffn - (8 + 1) * 3 * h * moe_ffn - 8 * h)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_kimi_at_tp8_is_refused_with_the_estimate_in_seconds(tmp_path, backend):
    t0 = time.time()
    cp = run_cli(["probe", "--engine", backend, "--config", str(KIMI), "--nproc", "8", "--out", str(tmp_path / "r")],
                 timeout=120)
    took = time.time() - t0
    assert cp.returncode == 2, cp.stderr[-3000:]
    line = one_line(cp)
    assert "KimiK25ForConditionalGeneration (its text model DeepseekV3ForCausalLM, under text_config)" in line
    assert "at tp 8 needs about" in line and " TB of memory here (8 ranks" in line and "1.03 T-parameter" in line
    for flag in ("--num-experts (now 384)", "--vocab-size (now 163840)", "--num-layers (now 61)"):
        assert flag in line
    assert "e.g. --num-layers 2 --num-experts 8 --vocab-size 4096 needs about" in line
    assert took < 30, f"{took:.0f}s: refused before any rank starts"
    assert not (tmp_path / "r").exists()


@pytest.mark.sglang
def test_a_config_sglangs_code_asserts_on_is_the_configs_problem_one_line_exit_2(tmp_path):
    """DeepSeek-V3's text model without rope_scaling: SGLang's CPU rope asserts it is set while the model is built
    from the config. The engine's own assertion on a user's config is the config's problem (the engine's
    file:line, the key it lacks), exit 2, never "a bug in tpprobe"."""
    pytest.importorskip("sglang")
    text = dict(json.loads(KIMI.read_text())["text_config"], model_type="deepseek_v3", first_k_dense_replace=3,
                n_routed_experts=256, architectures=["DeepseekV3ForCausalLM"])
    del text["rope_scaling"]
    cfg = tmp_path / "K.json"
    cfg.write_text(json.dumps(text))
    cp = run_cli(["probe", "--engine", "sglang", "--config", str(cfg), "--nproc", "2", "--num-layers", "2",
                  "--num-experts", "2", "--vocab-size", "1024", "--dtype", "float32", "--layers", "0",
                  "--out", str(tmp_path / "r")], timeout=300)
    assert cp.returncode == 2, cp.stderr[-3000:]
    import sglang.srt.layers.rotary_embedding.factory as factory
    at = next(i for i, ln in enumerate(Path(factory.__file__).read_text().splitlines(), 1)
              if ln.strip() == "assert rope_scaling is not None")
    assert one_line(cp) == (
        f"tpprobe: error: --config {cfg}: SGLang's code cannot build this model from it: "
        f"sglang/srt/layers/rotary_embedding/factory.py:{at} (get_rope_cpu) fails `assert rope_scaling is not None`; "
        f"the config has no 'rope_scaling', which that code needs: add it as the model's published config.json has it")
    assert not (tmp_path / "r").exists()


def test_a_config_that_is_no_json_is_refused_before_the_engine_loads(tmp_path):
    bad = tmp_path / "notjson.json"
    bad.write_text("this is not json")
    t0 = time.time()
    cp = run_cli(["probe", "--engine", "sglang", "--config", str(bad), "--out", str(tmp_path / "r")], timeout=120)
    assert cp.returncode == 2, cp.stderr[-3000:]
    assert f"--config {bad}: cannot read a JSON config" in one_line(cp)
    assert time.time() - t0 < 15, "said before SGLang is imported"


def test_the_contract_reads_the_wrapper_and_names_the_text_architecture(tmp_path):
    draft = tmp_path / "draft.json"      # the seed's draft: EAGLE-3 ids [-1, 2, 30]
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                 "hidden_size": 7168, "num_hidden_layers": 1,
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 2, 30],
                                                  "use_aux_hidden_state": True}}))
    cp = run_cli(["layers", "--draft-config", str(draft), "--target-config", str(KIMI), "--json"], timeout=120)
    assert cp.returncode == 1, cp.stderr[-3000:]
    res = json.loads(cp.stdout)
    assert (res["target_arch"], res["target_text_arch"], res["num_layers"]) == \
        ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", 61)
    assert res["target_class"] == "KimiK25ForConditionalGeneration"       # SGLang's own wrapper, its rule
    eng = res["engines"]
    assert "error" not in eng and (eng["sglang_arch"], eng["vllm_arch"]) == \
        ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM")
    assert any("KimiK25ForConditionalGeneration hands the ids to its text model DeepseekV3ForCausalLM" in n
               for n in eng["notes"])
    assert "unknown vLLM arch" not in cp.stdout + cp.stderr


@pytest.mark.sweep
@pytest.mark.sglang
def test_kimi_at_real_width_runs_healthy_on_cpu_gloo(tmp_path):
    """Measured: 118 s wall, 5.0 GB peak per rank (the estimate: 5.5 GB), 2 cores."""
    pytest.importorskip("sglang")
    cp = run_cli(["probe", "--engine", "sglang", "--config", str(KIMI), "--nproc", "2", "--num-layers", "2",
                  "--num-experts", "2", "--vocab-size", "1024", "--dtype", "float32", "--tokens", "8", "--json",
                  "--out", str(tmp_path / "r")], timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    rep = json.loads(cp.stdout[cp.stdout.index("{"):])
    assert [f for f in rep["findings"] if f["severity"] == "failure"] == []
    assert rep["settings"]["hidden"] == 7168 and rep["settings"]["num_layers"] == 2
    assert rep["slots"] and all(s["ok"] for s in rep["slots"])
