import torch, traceback
def worker(ctx, arch="qwen3"):
    from tpprobe.sglang.tiny import build_target, hf_reference
    t = build_target(ctx, arch, 4, 5, 3, torch.float32, [-1, 0, 2], attn_dp=2)
    _, hs, logits = hf_reference(arch, 4, 5, 3, prenorm_last=True)
    from tpprobe.hooks import Tap
    try:
        with torch.no_grad(), Tap(t.model) as tap:
            res = t.forward()
    except Exception:
        return {"err": traceback.format_exc()[-3000:]}
    aux = t.packed_aux(res)
    slots = [[k for k, h in enumerate(hs) if torch.allclose(c, h, atol=1e-4)] for c in aux.split(64, -1)]
    return {"slots": slots, "logit": (res.next_token_logits - logits[-1]).abs().max().item(),
            "audit": [(a.where, a.group, a.group_size) for a in tap.allreduces],
            "streams": [torch.allclose(tap.captures[f"layer.{k}.out"], hs[k+1], atol=1e-4) for k in range(4)]}
