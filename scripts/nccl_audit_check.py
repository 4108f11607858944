"""Does the collective audit work on NCCL collectives?  World-1 NCCL group on one GPU (the only
NCCL this one-GPU machine can run): all_reduce a CUDA tensor bare, under an Audit on its kernel
path, under its dispatch-mode path, and under a Tap with fingerprints; each step prints how long it
took, and faulthandler dumps every thread's stack if a step hangs (a diagnosis for the
2-GPU invariance run whose NCCL ranks "wrote nothing", and bench/nccl_overhead.py --collectives
that did not finish)."""
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def step(name, fn, n=20):
    faulthandler.dump_traceback_later(25, exit=True)
    t0 = time.perf_counter()
    try:
        for _ in range(n):
            r = fn()
        torch.cuda.synchronize()
        print(f"{name}: ok, {(time.perf_counter() - t0) / n * 1e6:.1f} us each; "
              f"{r if r is not None else ''}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    faulthandler.cancel_dump_traceback_later()


def main():
    faulthandler.enable(all_threads=True)       # a crash in native code prints where
    from tpprobe.capture.audit import Audit
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29641")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    x = torch.ones(1, 7168, device=dev, dtype=torch.bfloat16)
    step("bare all_reduce", lambda: dist.all_reduce(x))

    def audited(use_mode):
        a = Audit(lambda t: ("m", None, "x", None), keep=lambda w: False, use_mode=use_mode)
        with a:
            dist.all_reduce(x)
        return f"path {a.path}, {len(a.records)} record(s)"
    step("audit, kernel path", lambda: audited(False))     # recorded at ProcessGroup.allreduce's door
    from tpprobe.capture import audit as audit_mod
    audit_mod.set_doors(False)
    step("audit, kernel path, doors closed", lambda: audited(False))   # recorded by the dispatcher kernel
    audit_mod.set_doors(True)
    step("audit, mode path", lambda: audited(True))

    from tpprobe.fingerprint.reference import Deferred

    def fp_audit():
        d = Deferred(0x7470, 32)
        a = Audit(lambda t: ("m", None, "x", None), keep=lambda w: False, summarize=d)
        with a:
            dist.all_reduce(x)
        d.resolve()
        return f"{len(a.records)} record(s), out fp {a.records[0].out_summary.fp.bit_hash if a.records else None}"
    step("audit + fingerprints", fp_audit)
    with torch.no_grad():
        from tpprobe.engines.builtin.graph import device_weights as weights_on
        from tpprobe.capture.hooks import Tap
        from tpprobe.engines.builtin.model import BuiltinConfig, TPModel
        from tpprobe.core.target import RankContext
        cfg = BuiltinConfig(num_layers=2, hidden=512, heads=8, ffn=1024, vocab=256, tokens=1, dtype=torch.bfloat16,
                            layer_ids=[-1, 0, 1])
        ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="nccl")
        model = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
        ids = torch.zeros(1, dtype=torch.long, device=dev)
        for l in model.layers:
            for m in (l.self_attn.o_proj, l.mlp.down_proj):
                m.register_forward_hook(lambda mod, args, o: dist.all_reduce(o))

        def tap(summ):
            d = Deferred(0x7470, 32) if summ else None
            with Tap(model, keep=lambda n: False, keep_allreduce_tensors=False, summarize=d) as t:
                model(ids)
            if d:
                d.resolve()
            return f"{len(t.allreduces)} all-reduces, modules {sorted({r.module for r in t.allreduces})[:2]}"
        step("Tap, model all-reducing its row outputs", lambda: tap(False))
        step("Tap + fingerprints, same", lambda: tap(True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
