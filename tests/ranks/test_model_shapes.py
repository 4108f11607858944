"""The model's own size and shape decide, before any rank starts.

- the default --layers follows the model's depth (a 2-layer built-in model with no --layers runs
  and captures -1,0; the 6-layer default stays -1,1,3).
- `--engine sglang --config cfg.json` takes the config's num_hidden_layers and architecture;
  built-in-only options (--heads, ...) with --engine sglang or --model are a one-line usage
  error (exit 2), never ignored; shapes that do not split over the TP size are refused before
  any rank starts, saying which --nproc works; the tiny SGLang models run at tp 8 (Kimi-K2's
  serving shape).
Every run is the real CLI with its own gloo ranks.
"""
import json
import time

import pytest

from tests.helpers.ranks import probe, run_cli
from tpprobe.engines.sglang import INSTALL_HINT, available

no_sglang = pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")


def one_error_line(cp) -> str:
    lines = [x for x in cp.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, cp.stderr[-3000:]
    return lines[0]


# ---- default layer ids follow the model's size -------------------------------------------
def test_the_default_ids_follow_the_builtin_models_depth():
    from tpprobe.config.options import builtin_layer_ids
    assert builtin_layer_ids(6) == [-1, 1, 3]              # today's default, kept for the 6-layer model
    assert [builtin_layer_ids(n) for n in (1, 2, 3, 4, 5)] == [[-1], [-1, 0], [-1, 1], [-1, 1, 2], [-1, 1, 3]]


@pytest.mark.parametrize("layers,ids", [(2, [-1, 0]), (3, [-1, 1])])
def test_a_small_builtin_model_without_layers_runs_healthy(tmp_path, layers, ids):
    rc, rep, cp = probe(tmp_path / "r", "--num-layers", str(layers))
    assert rc == 0, cp.stderr[-3000:]
    assert rep["settings"]["layer_ids"] == ids and rep["settings"]["num_layers"] == layers


def test_the_help_says_the_default_for_small_models():
    from tpprobe.config.options import ProbeOptions, typer_parameters
    helps = {name: h for name, _, _, _, h in typer_parameters(ProbeOptions)}
    assert "2: -1,0" in helps["layers"] and "1: -1" in helps["layers"]


# ---- built-in-only options, --config's own depth and arch, shapes before the build ----------
@pytest.mark.parametrize("args,flag", [(["--engine", "sglang", "--heads", "4"], "--heads"),
                                       (["--engine", "sglang", "--arch", "qwen3", "--hidden", "128", "--ffn", "64"],
                                        "--hidden, --ffn"),
                                       (["--model", "examples.my_model:build", "--vocab", "50"], "--vocab")])
def test_a_builtin_only_option_elsewhere_is_a_usage_error(tmp_path, args, flag):
    cp = run_cli(["probe", "--out", str(tmp_path / "r"), *args], timeout=60)
    assert cp.returncode == 2, cp.stderr[-3000:]
    line = one_error_line(cp)
    verb = "shape" if "," in flag else "shapes"
    assert f"{flag} {verb} the built-in model only" in line and line.endswith(f"drop {flag}"), line
    assert not (tmp_path / "r").exists()


def _config(tmp_path, **kw):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(kw))
    return p


def test_a_config_names_its_depth_and_architecture(tmp_path):
    from tpprobe.probe.prepare import options_from_cli
    cfg = _config(tmp_path, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=61,
                  num_attention_heads=128, n_routed_experts=256, moe_intermediate_size=2048, intermediate_size=18432)
    o = options_from_cli(engine="sglang", config=str(cfg))
    assert (o.arch, o.num_layers, o.layers) == ("deepseek_v2", 61, [0, 2, 4])
    again = options_from_cli(engine="sglang", config=str(cfg), num_layers=4)     # --num-layers wins
    assert again.num_layers == 4
    argv = o.to_argv()
    assert "--heads" not in argv and argv[argv.index("--num-layers") + 1] == "61"
    assert argv[argv.index("--arch") + 1] == "deepseek_v2"


@pytest.mark.parametrize("args,says", [
    (["--arch", "deepseek_v2", "--nproc", "16"],
     "--arch deepseek_v2 at tp=16: its 8 attention heads do not split over 16 ranks; its 8 experts are fewer than "
     "the 16 ranks (SGLang's MoE refuses that); use --nproc 1, 2, 4 or 8"),
    (["--arch", "llama", "--nproc", "3"], "--arch llama at tp=3: its 8 attention heads do not split over 3 ranks"),
])
def test_a_shape_that_does_not_split_is_refused_before_any_rank_starts(tmp_path, args, says):
    t0 = time.time()
    cp = run_cli(["probe", "--engine", "sglang", "--out", str(tmp_path / "r"), *args], timeout=60)
    took = time.time() - t0
    assert cp.returncode == 2, cp.stderr[-3000:]
    assert says in one_error_line(cp)
    assert took < 20, f"{took:.0f}s: the shape must be refused before a build"


def test_a_config_that_does_not_split_says_what_to_pass(tmp_path):
    cfg = _config(tmp_path, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=61,
                  num_attention_heads=4, n_routed_experts=8)
    cp = run_cli(["probe", "--engine", "sglang", "--config", str(cfg), "--nproc", "8", "--out", str(tmp_path / "r")],
                 timeout=60)
    assert cp.returncode == 2, cp.stderr[-3000:]
    assert one_error_line(cp).endswith(f"--config {cfg} at tp=8: its 4 attention heads do not split over 8 ranks; "
                                       f"use --nproc 1, 2 or 4")


@pytest.mark.sglang
@no_sglang
def test_a_config_without_arch_builds_its_own_depth(tmp_path):
    cfg = _config(tmp_path, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=3,
                  hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                  vocab_size=200, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  torch_dtype="float32")
    rc, rep, cp = probe(tmp_path / "r", "--engine", "sglang", "--config", str(cfg), "--tokens", "4", timeout=300)
    assert rc == 0, cp.stderr[-3000:]
    s = rep["settings"]
    assert (s["arch"], s["num_layers"], s["layer_ids"]) == ("qwen3", 3, [-1, 1]), s


@pytest.mark.sglang
@pytest.mark.sweep      # 8 ranks on 2 cores: ~100 s, the sweep tier's (run before a change is called done)
@no_sglang
def test_the_tiny_deepseek_runs_at_tp_8(tmp_path):
    """Kimi-K2's serving shape: MLA + MoE over 8 gloo ranks, healthy (about 2 minutes on 2 cores)."""
    rc, rep, cp = probe(tmp_path / "r", "--engine", "sglang", "--arch", "deepseek_v2", "--num-layers", "2",
                        "--tokens", "4", "--timeout", "300", nproc=8, timeout=540)
    assert rc == 0, cp.stderr[-3000:]
    assert rep["settings"]["world_size"] == 8 and rep["settings"]["arch"] == "deepseek_v2"
    assert [f for f in rep["findings"] if f["severity"] == "failure"] == []


def test_a_user_model_without_layers_gets_ids_of_its_own_depth(tmp_path):
    """The documented 2-layer example (examples/my_model.py) without --layers: was refused ("--layers [3]
    out of range ... (2 layers)"); now the default follows its depth, read on the ranks after the build."""
    rc, rep, cp = probe(tmp_path / "r", "--model", "examples.my_model:build")
    assert rc == 0, cp.stderr[-3000:]
    s = rep["settings"]
    assert s["num_layers"] == 2 and s["requested_layer_ids"] == [-1, 0], s
