"""SGLang's own EAGLE-3 draft class, `LlamaForCausalLMEagle3`, run on CPU in this process for `tpprobe accept
--engine sglang` (tpprobe.eagle3.accept scores it beside tpprobe's torch re-implementation)."""
from __future__ import annotations

import torch


class SGLangEagle3:
    """SGLang's own `LlamaForCausalLMEagle3` on CPU (tp 1 in this process), weights through its
    `load_weights` (legacy names, d2t handling and all). Logits are its final hidden state times
    its lm_head (the logits processor itself keeps only the last token of an EXTEND batch)."""

    def __init__(self, d):      # tpprobe.eagle3.accept.draft.Draft: config, weights, d2t, draft_vocab
        from . import require
        require()
        from . import cpu_mode
        cpu_mode.enable()
        _init_single_process()
        from transformers import LlamaConfig
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

        c = dict(d.config)
        for drop in ("architectures", "auto_map", "_name_or_path", "torch_dtype", "dtype"):
            c.pop(drop, None)
        cfg = LlamaConfig(**c)
        cfg.draft_vocab_size = d.draft_vocab
        self.d = d
        self.device = torch.device("cpu")
        with set_default_torch_dtype(torch.float32):
            self.model = LlamaForCausalLMEagle3(cfg).eval()
        ws = [(("model." if not k.startswith("lm_head") else "") + k, v.float()) for k, v in d.weights.items()]
        if d.d2t is not None:
            ws.append(("d2t", d.d2t))
        self.model.load_weights(ws)

    def logits(self, feats, next_ids):
        from types import SimpleNamespace
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        rt = SimpleNamespace(ids=next_ids, model=self.model, config=SimpleNamespace(num_hidden_layers=1),
                             dtype=torch.float32, mla=False, capture=False, attn_dp=1)
        from .tiny import extend_batch
        fb, backend = extend_batch(rt)
        fb.spec_info = SimpleNamespace(hidden_states=feats.float())
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(fb)
            h, _ = self.model.model(next_ids, fb.positions, fb)
        return h @ self.model.lm_head.weight[: self.d.draft_vocab].t()


def _init_single_process() -> None:
    import tempfile
    import torch.distributed as dist
    if dist.is_initialized():
        return
    f = tempfile.NamedTemporaryFile(prefix="tpprobe-accept-", delete=False)
    f.close()
    dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
    from .dist import publish_parallel_state
    publish_parallel_state(0, 1, 0, "gloo", "cpu")
