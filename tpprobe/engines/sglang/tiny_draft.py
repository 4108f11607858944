"""SGLang's own EAGLE-3 draft (`LlamaForCausalLMEagle3`) on CPU gloo, fed the way its EAGLE worker feeds it.

SGLang 0.5.23's EAGLE worker (speculative/eagle_worker_v2.py) hands the draft the target's packed aux
hidden states through the batch's spec info: after a prefill, `EagleDraftWorker._draft_extend_for_prefill`
(eagle_worker_v2.py:961-1096) rotates the input ids one to the left (the sampled token last, per request)
and installs `EagleDraftExtendInput(hidden_states=target_hidden_states)` (:1009-1014; the tensor is
`batch_output.logits_output.hidden_states`, :1597); after a verify, `_draft_extend_for_decode` does the
same with `batch_result.logits_output.hidden_states` (:1149-1157). The draft model reads it at
models/llama_eagle3.py:237 (`forward_batch.spec_info.hidden_states`) and, when it is wider than the
draft's hidden size, projects it with `fc` (:238-247).

`draft_extend_for_prefill(...)` below does what `_draft_extend_for_prefill` does up to the draft's forward
(the rotation, the spec info, `CaptureHiddenMode.LAST`) with SGLang's own `EagleDraftExtendInput`,
`ForwardBatch` and the draft model class, on the tiny target's batch. What it does not run: the worker
object itself (`EagleDraftWorker.__init__` builds a ModelRunner with CUDA streams, memory pools and
graph runners, which does not start on CPU here), sampling of the draft's top-k and the draft's KV plan.

CPU only (the tiny target's `cpu_mode`).
"""
from __future__ import annotations

from typing import Optional

import torch


def draft_config(target_config, layer_ids: Optional[list[int]], *, top_level_only: bool = False):
    """A one-layer EAGLE-3 draft config for `target_config` (its hidden size, heads and vocab); its ids
    in `eagle_config.eagle_aux_hidden_state_layer_ids` (where SGLang's target side reads them), or,
    with `top_level_only`, only at the top level (where the draft alone reads them: F19)."""
    from transformers import LlamaConfig

    c = target_config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
                      max_position_embeddings=getattr(c, "max_position_embeddings", 256),
                      rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = None
    if layer_ids is not None:
        if top_level_only:
            cfg.eagle_aux_hidden_state_layer_ids = list(layer_ids)
            cfg.num_aux_hidden_states = len(layer_ids)
        else:
            cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    return cfg


def build_draft(config, seed: int, dtype: torch.dtype = torch.float32):
    """SGLang's `LlamaForCausalLMEagle3` on this rank (SGLang's parallel state already published), every
    parameter filled from a seeded generator by its name (the same on every rank of a shard)."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    with set_default_torch_dtype(dtype):
        model = LlamaForCausalLMEagle3(config).eval()
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            if name.endswith("weight") and p.dim() == 1:     # norms
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return model


def load_draft(folder, target, dtype: torch.dtype = torch.float32):
    """SGLang's `LlamaForCausalLMEagle3` from an HF draft folder (config.json, *.safetensors), loaded with its
    own `load_weights` (legacy `midlayer.*` names mapped by it) and given the target's embedding as the EAGLE
    worker does for an EAGLE-3 draft (`self.draft_runner.model.set_embed(embed)`, eagle_worker_v2.py:363). Its
    config keeps `_name_or_path` (the folder), as a server's draft config does."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import AutoConfig

    from tpprobe.engines.sglang.tiny import folder_weights

    cfg = AutoConfig.from_pretrained(str(folder))         # as SGLang's ModelConfig reads a draft's config
    with set_default_torch_dtype(dtype):
        model = LlamaForCausalLMEagle3(cfg).eval()
    model.load_weights([(k, v.to(dtype)) for k, v in folder_weights(folder).items()])
    model.set_embed(target.get_embed())
    return model


def draft_extend_for_prefill(draft, seqs: list, aux: torch.Tensor, next_tokens: torch.Tensor):
    """The draft-extend forward after a prefill of `seqs` (one tensor of ids per request), as
    `_draft_extend_for_prefill` builds it: each request's ids rotated left with its sampled token last,
    `EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1)`, CaptureHiddenMode.LAST; returns
    the draft's LogitsProcessorOutput."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    from types import SimpleNamespace

    from tpprobe.engines.sglang.tiny import extend_batch

    rotated = [torch.cat((s[1:], next_tokens[i].reshape(1).to(s.dtype))) for i, s in enumerate(seqs)]
    # what extend_batch reads of a runtime: the draft's one attention layer sizes its KV pool
    rt = SimpleNamespace(model=draft, config=draft.config, ids=torch.cat(rotated), dtype=aux.dtype, mla=False,
                         capture=False, attn_dp=1)
    fb, backend = extend_batch(rt, rotated)
    fb.spec_info = EagleDraftExtendInput(hidden_states=aux, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1)
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        return draft(fb.input_ids, fb.positions, fb)
