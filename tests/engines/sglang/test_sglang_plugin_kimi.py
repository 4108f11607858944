"""The SGLang plugin on SGLang's own Kimi-K2.5 class: `KimiK25ForConditionalGeneration` (built by SGLang on
CPU gloo, tp 2, its MoonViT vision tower tiny) around the tiny DeepSeek-V3 language model, loaded through
SGLang's `load_plugins()` with the plugin's default model list. The wrapper's forward embeds the prompt
(`general_mm_embed_routine`) and hands its `language_model` the embeddings (`input_embeds`, input_ids None):
the plugin wraps the wrapper, so the embedding is captured, and the language model's own (also wrapped)
forward inside it makes no second step. The step is healthy under `tpprobe report`, every point equal to
HF's hidden states of the same weights.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED, IDS = 3, 6, 5, [0, 2]


def worker(ctx):
    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from sglang.srt.configs.kimi_k25 import KimiK25Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    from tpprobe.engines.sglang import tiny
    from tpprobe.engines.sglang.tiny_weights import hf_reference

    t = tiny.build_target(ctx, "deepseek_v2", L, TOKENS, SEED, torch.float32, IDS)   # DeepseekV3ForCausalLM
    vision = dict(vt_hidden_size=16, vt_num_hidden_layers=1, vt_num_attention_heads=2, vt_intermediate_size=32,
                  mm_hidden_size=16, text_hidden_size=t.hidden_size, patch_size=14, merge_kernel_size=[2, 2])
    config = KimiK25Config(text_config=t.model.config.to_dict(), vision_config=vision)
    config.encoder_only, config.language_only = False, True       # what SGLang's ModelConfig sets on it
    with set_default_torch_dtype(torch.float32):
        model = KimiK25ForConditionalGeneration(config).eval()
    # the wrapper's own weights (vision tower, mm_projector) are allocated, not loaded: give them the same
    # values on every rank, as a checkpoint load would, or the report rightly names a replicated parameter
    # that differs across ranks
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
    model.language_model = t.model            # the seeded, sharded DeepSeek-V3 text model
    model.set_eagle3_layers_to_capture(IDS)   # the wrapper hands the ids to its language model
    rt = tiny._Runtime(model=model, config=t.model.config, ids=t.input_ids, dtype=torch.float32, mla=True,
                       capture=True)
    out = tiny._run(rt)
    _, hs, _ = hf_reference("deepseek_v2", L, TOKENS, SEED, prenorm_last=True)
    return {"hf": hs, "aux": tiny.packed_aux(out), "inner": type(model.language_model).__name__}


def test_the_plugin_captures_sglangs_kimi_wrapper_with_its_embedding(tmp_path):
    from tpprobe.formats.capture_dir import load_run

    # the draft was trained on the embedding and layer 1's output (HF hidden_states 0 and 2): said, so the
    # slots are checked against the training, not only against the engine's own ids
    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_KEEP": "*",
           "TPPROBE_DRAFT_TRAINED": "ids:0,2"}
    res = run_ranks(f"{__name__}:worker", 2, {}, env=env, timeout=300)
    assert res[0]["inner"] == "DeepseekV3ForCausalLM"
    group = tmp_path / "dp0-pp0"
    assert sorted(p.name for p in group.iterdir()) == ["step-000000-extend"]     # one step, not two
    run = load_run(group / "step-000000-extend")
    assert run.problems == [] and sorted(run.records) == [0, 1]
    hs = res[0]["hf"]
    for rank, rec in run.records.items():
        assert rec.meta.extra["model"] == "KimiK25ForConditionalGeneration"
        assert rec.meta.extra["layers_to_capture"] == IDS
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4), rank
        for k in range(L):
            assert torch.allclose(rec.tensors[f"layer.{k}.out"], hs[k + 1], atol=1e-4), (rank, k)
        assert torch.equal(rec.tensors["aux.packed"], res[rank]["aux"])
        assert torch.allclose(rec.tensors["aux.packed"], torch.cat([hs[0], hs[2]], -1), atol=1e-4)
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(group / "step-000000-extend"), "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep["findings"] == [] and rep["slots"] and all(s["ok"] for s in rep["slots"])
    assert "language_model.model.embed_tokens" in json.dumps(rep["coverage"])


def test_an_eagle3_drafts_forward_passes_through_uncounted(tmp_path, monkeypatch):
    """SGLang's EAGLE-3 draft class inherits LlamaForCausalLM.forward (which the default list wraps) and runs in
    the target's worker: the plugin hands its forwards straight to SGLang, no step counted, no Tap."""
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    from tpprobe.engines.sglang import plugin

    monkeypatch.setenv("TPPROBE_CAPTURE_DIR", str(tmp_path))
    monkeypatch.setitem(plugin._STEPS, "n", 0)
    draft = LlamaForCausalLMEagle3.__new__(LlamaForCausalLMEagle3)     # SGLang's class, not built: not called
    calls = []
    out = plugin._around_forward(lambda self, *a, **k: calls.append(a) or "draft-out", draft, "ids", "pos", "fb")
    assert (out, calls, plugin._STEPS["n"]) == ("draft-out", [("ids", "pos", "fb")], 0)
    assert list(tmp_path.iterdir()) == []
