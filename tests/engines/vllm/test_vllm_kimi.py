"""The tpprobe plugin inside vLLM's own engine on CPU serving vLLM's Kimi-K2.5 class,
`KimiK25ForConditionalGeneration` (vllm/model_executor/models/kimi_k25.py: a MoonViT vision tower and its
projector around a DeepSeek-V3 `language_model`), at tp 2, from a tiny checkpoint folder as the hub ships one:
config.json (`kimi_k25`, transformers' Kimi_K25Config: a tiny vision config, a tiny DeepSeek-V3 text config under
`text_config`), a tokenizer that knows `<|media_pad|>`, the image processor's preprocessor_config.json.

vLLM's CPU engine runs MLA through its CPU_MLA backend, whose decode kernel takes only the latent width of the
real DeepSeek-V3 (kv_lora_rank 512 + rope 64 = 576; any other: `Unsupported block size: 16` at the first decode):
the tiny text model keeps those two widths and is tiny elsewhere.

As served, vLLM embeds the prompt outside a multimodal model's forward and calls it with `inputs_embeds` and no
`input_ids`: the plugin captures nothing, says so in one line with the way out, and the engine's tokens are the
ones it gives without the plugin (vLLM's seeded dummy weights: the checkpoint has no vision weights). Served
with vLLM's `language_model_only=True` (`--language-model-only`), the runner passes `input_ids` and the plugin
captures the text model inside the wrapper: every step HEALTHY with full coverage, the prefill's streams equal to
HF's DeepSeek-V3 forward of the same seeded text weights.

The vLLM tier: `.venv-vllm/bin/python -m pytest -m vllm_live tests/engines/vllm/test_vllm_kimi.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engines.vllm.test_vllm_live import _need_vllm, report, serve, steps  # noqa: F401 - the tier's skip

pytestmark = [pytest.mark.vllm_live]
L, SEED = 3, 7
PROMPT = [1, 5, 9, 30, 77, 100, 150]      # ids below the media token (199)
MEDIA = 199

ENGINE = r'''
import json, os, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=128, enforce_eager=True,
              distributed_executor_backend="mp", attention_config={"backend": "CPU_MLA"},
              **json.loads(os.environ["KIMI_TEST_ENGINE_KW"]))
    outs = llm.generate([{"prompt_token_ids": %s}], SamplingParams(max_tokens=int(sys.argv[2]), temperature=0,
                                                                    detokenize=False))
    status = llm.collective_rpc("tpprobe_status") if os.environ.get("TPPROBE_CAPTURE_DIR") else None
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "status": status}),
          flush=True)
''' % PROMPT


def text_config():
    from tpprobe.engines.sglang.cpu_mode import fill_deepseek_config
    from tpprobe.engines.sglang.tiny_archs import tiny_config

    t = tiny_config("deepseek_v2", L)       # DeepseekV3ForCausalLM: layer 0 dense, then MoE
    fill_deepseek_config(t)
    # the latent width vLLM's CPU MLA decode kernel takes (DeepSeek-V3's own): kv_lora_rank 512 + rope 64
    t.kv_lora_rank, t.qk_rope_head_dim, t.head_dim = 512, 64, 64
    t.qk_head_dim = t.qk_nope_head_dim + t.qk_rope_head_dim
    return t


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Kimi_K25Config, PreTrainedTokenizerFast

    from tpprobe.engines.sglang.tiny_weights import seeded_hf_model, unfuse_experts

    d = tmp_path_factory.mktemp("tiny-kimi-k25")
    t = text_config()
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=14,
                  merge_kernel_size=[2, 2], pos_emb_height=8, pos_emb_width=8, pos_emb_time=2)
    c = Kimi_K25Config(text_config=t.to_dict(), vision_config=vision, projection_hidden_size=16,
                       image_token_id=MEDIA, video_token_id=MEDIA - 1, tie_word_embeddings=False)
    c.architectures = ["KimiK25ForConditionalGeneration"]
    c.save_pretrained(d)
    # the text model's weights, seeded the same in every process, one tensor per expert as checkpoints have them
    hf = seeded_hf_model(t, SEED)
    save_file({f"language_model.{k}": v.contiguous() for k, v in unfuse_experts(hf.state_dict().items())},
              str(d / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(MEDIA)}
    vocab["<|media_pad|>"] = MEDIA
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t1",
                            additional_special_tokens=["<|media_pad|>"]).save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 64, "patch_limit_on_one_side": 8,
        "fixed_output_tokens": None, "temporal_merge_kernel_size": 4, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "in_patch_limit_each_frame": 64, "in_patch_limit_video": None}}))
    return d


def kimi(tmp: Path, model: Path, engine_kw: dict, capture: bool = True, **env):
    """One engine run of ENGINE (LLM(..., **engine_kw), 4 greedy tokens): its RESULT, capture folder, log."""
    return serve(tmp, model, tokens=4, capture=capture, engine=ENGINE, KIMI_TEST_ENGINE_KW=json.dumps(engine_kw),
                 **env)


def hf_streams(ids: list[int]) -> list[torch.Tensor]:
    """HF DeepSeek-V3's forward of the checkpoint's text weights: the embedding, then each layer's output
    (the last one before the final norm, as tpprobe's layer.{L-1}.out)."""
    from tpprobe.engines.sglang.tiny_weights import seeded_hf_model

    hf = seeded_hf_model(text_config(), SEED)
    box = {}

    def before_norm(module, args):
        box["last"] = args[0][0].detach().clone()

    hf.model.norm.register_forward_pre_hook(before_norm)
    with torch.no_grad():
        hs = hf.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return [h[0] for h in hs[:L]] + [box["last"]]


@pytest.mark.sweep      # two engine starts (with and without the plugin), ~150 s on 2 cores
def test_served_multimodal_forwards_are_not_captured_said_once_tokens_unchanged(checkpoint, tmp_path):
    (tmp_path / "off").mkdir()
    plain, _, _ = kimi(tmp_path / "off", checkpoint, {"load_format": "dummy"}, capture=False)
    res, cap, log = kimi(tmp_path, checkpoint, {"load_format": "dummy"})
    assert res["tokens"] == plain["tokens"] and len(res["tokens"][0]) == 4, (res, plain)
    said = [x for x in log.splitlines() if "not captured" in x]
    assert len(said) == 1, "\n".join(said) or log[-4000:]       # one line for the TP group, not one per rank
    assert said[0].endswith("KimiK25ForConditionalGeneration: forwards with inputs_embeds and no input_ids are not "
                            "captured (vLLM embeds the prompt outside a multimodal model's forward): serve with "
                            "--language-model-only to capture the text model"), said
    assert "attached on every worker (collective_rpc tpprobe_attach): tp_rank 0: yes, tp_rank 1: yes" in log
    # both workers saw every forward (a prefill, three decodes), captured none, wrote nothing, did not fail
    assert [(x["tp_rank"], x["forwards"], x["captured"], x["bytes"], x["failed"]) for x in res["status"]] == \
        [(0, 4, 0, 0, False), (1, 4, 0, 0, False)], res["status"]
    assert not cap.exists() or not list(cap.rglob("*")), list(cap.rglob("*"))
    assert f'File "{Path(__file__).resolve().parents[3] / "tpprobe"}' not in log, log[-4000:]


def test_language_model_only_captures_the_text_model_healthy(checkpoint, tmp_path):
    from tpprobe.engines.vllm.layer_ids import resolve
    from tpprobe.formats.capture_dir import load_run

    # the capture rule of the wrapper's EAGLE-3 ids is its text model's (kimi_k25.py hands them over)
    assert resolve("KimiK25ForConditionalGeneration") == "DeepseekV3ForCausalLM"
    res, cap, log = kimi(tmp_path, checkpoint, {"language_model_only": True}, TPPROBE_KEEP="*")
    assert "not captured" not in log, log[-4000:]
    assert [(x["tp_rank"], x["forwards"], x["captured"], x["failed"]) for x in res["status"]] == \
        [(0, 4, 4, False), (1, 4, 4, False)], res["status"]
    found = [d.name for d in steps(cap)]
    assert found == ["step-000000-extend", "step-000001-decode", "step-000002-decode", "step-000003-decode"], found
    rc, failures, rep = report(cap)
    assert (rc, rep["findings"]) == (0, []), json.dumps(rep)[:4000]
    assert [(r["step"], r["forward_mode"], r["failures"]) for r in rep["steps"]] == \
        [(0, "extend", 0), (1, "decode", 0), (2, "decode", 0), (3, "decode", 0)], rep["steps"]
    cov = rep["coverage"]       # the wrapper's text model, whole: its embedding, every layer, every reduce
    assert (cov["embed"], cov["layer_list"], cov["layers_found"], cov["layers_ran"], cov["layer_classes"]) == \
        ("language_model.model.embed_tokens", "language_model.model.layers", L, L, ["DeepseekV2DecoderLayer"]), cov
    assert cov["reduces_per_place"] == {"embed": {"0": 1, "1": 1}, **{f"layer.{k}": {"0": 2, "1": 2}
                                                                       for k in range(L)}}, cov
    # the prefill's streams on both ranks: HF DeepSeek-V3's of the same text weights and prompt
    run = load_run(cap / "dp0-pp0" / "step-000000-extend")
    assert run.problems == [] and sorted(run.records) == [0, 1]
    hs = hf_streams(PROMPT)
    for rank, rec in run.records.items():
        assert rec.meta.extra["model"] == "KimiK25ForConditionalGeneration"
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4), rank
        for k in range(L):
            assert torch.allclose(rec.tensors[f"layer.{k}.out"], hs[k + 1], atol=1e-4), (rank, k)
