"""allreduce's door in C against the Python door, on one GPU (world-1 NCCL): checked forwards of the
built-in model with the 9 all-reduces a tp-2 model issues (the embedding's and every row-parallel
output's, reduced by hooks over the world-1 group), the doors alternated, fingerprinted and with
every all-reduce's tensors kept; printed as one JSON line (tests/ranks/test_hooks.py runs it)."""
import hashlib
import json

import torch
import torch.distributed as dist


def _digest(t):
    return None if t is None else hashlib.sha1(t.detach().contiguous().view(torch.uint8).cpu().numpy()).hexdigest()


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # world 1: the store's own free port (none chosen here that a test beside it could hold)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1, device_id=dev)
    from tpprobe.capture.audit import DOORS
    from tpprobe.capture.hooks import Tap
    from tpprobe.capture.progress import Progress
    from tpprobe.core.target import RankContext
    from tpprobe.engines.builtin.model import BuiltinConfig, TPModel, full_weights, input_ids
    from tpprobe.fingerprint.reference import Deferred, resolved
    cfg = BuiltinConfig(num_layers=4, hidden=1024, heads=8, ffn=2048, vocab=512, tokens=8, dtype=torch.bfloat16)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="nccl")
    model = TPModel(full_weights(cfg), ctx, cfg).to(dev).eval()
    rows = [x for layer in model.layers for x in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    for m in [model.embed_tokens] + rows:
        m.register_forward_hook(lambda mod, args, o: dist.all_reduce(o))
    ids = input_ids(cfg).to(dev)

    def forward(c_door: bool, keep_ar: bool) -> dict:
        d, prog = Deferred(7, 32), Progress()
        with torch.no_grad(), Tap(model, keep=lambda n: False, summarize=d, keep_allreduce_tensors=keep_ar,
                                  progress=prog) as tap:
            armed = tap.auditor.native is not None
            if not c_door:
                tap.auditor.native = None          # every all-reduce through the Python door
            fast0 = DOORS.native.fast if DOORS.native is not None else None
            model(ids)
            fast = None if fast0 is None else DOORS.native.fast - fast0
        d.resolve()
        torch.cuda.synchronize()
        recs = [{**r.meta(), "inp_fp": json.dumps(resolved(r.inp_summary).to_json()),
                 "out_fp": json.dumps(resolved(r.out_summary).to_json()), "inp": _digest(r.inp), "out": _digest(r.out),
                 "timed": r.t0 > 0 and r.seconds > 0} for r in tap.allreduces]
        return {"armed": armed, "fast": fast, "records": recs, "events": [s for s, _ in prog.events],
                "completed": all(e.query() for _, e in prog.events), "issued": prog.issued,
                "points": {n: json.dumps(resolved(v).to_json()) for n, v in tap.summaries.items()},
                "taker": type(tap.summarize).__name__}

    forward(False, False)          # the first batch on the GPU builds the C module; every shape's entry
    out = {}
    for keep_ar in (False, True):
        for i, c_door in enumerate((True, False, True, False)):
            out[f"{'c' if c_door else 'python'}{i // 2} keep={keep_ar}"] = forward(c_door, keep_ar)
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
