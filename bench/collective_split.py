"""Where the host time of ONE audited collective goes.

    python bench/collective_split.py [--device cuda] [--hidden 7168] [--tokens 1] [--rounds 300]

World 1 (NCCL on a GPU, gloo on CPU). Each round runs every variant, in rotated order, over
--per collectives on one [tokens, hidden] tensor (in place: world 1 leaves it as it is) from an
idle device; the host time per collective is printed (median and mean of the rounds, us):
  off           dist.all_reduce, the audit's kernels not registered (and its doors closed)
  passthrough   the audit's kernels and doors in place, no Audit active
  audit         an Audit with a constant attribution, nothing else
  audit_event   + the Tap's completion event (torch.cuda.Event, recorded on the current stream)
  audit_fp      + a fingerprint of the input and of the output (one Deferred, read after the round)
  tap           a Tap (installed: every hook and its callbacks) around --per row-parallel modules,
                each all-reducing its output, minus the same Tap around the same modules with no
                collective (the Tap's per-collective cost as the probe pays it)
  *_kernel      the same with ProcessGroup's doors closed (capture/audit/doors.py): the collective
                goes through the audit's dispatcher kernel, as every collective did before the doors
Then: is dist.all_reduce blocking the host? The host time of one all_reduce issued behind
--busy-ms of queued device work (torch.cuda._sleep), against one from an idle device.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tpprobe.capture import audit as audit_mod  # noqa: E402
from tpprobe.capture.audit import Audit  # noqa: E402
from tpprobe.capture.hooks import Tap
from tpprobe.core.cuda import current_stream  # noqa: E402
from tpprobe.capture.progress import Progress  # noqa: E402
from tpprobe.fingerprint.reference import Deferred  # noqa: E402


class Row(torch.nn.Module):
    def __init__(self, reduce: bool):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        if self.reduce:
            dist.all_reduce(x)
        return x


class Layer(torch.nn.Module):
    def __init__(self, reduce: bool):
        super().__init__()
        self.o_proj = Row(reduce)

    def forward(self, x):
        return self.o_proj(x)


class Model(torch.nn.Module):
    def __init__(self, n: int, reduce: bool, hidden: int):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, hidden)
        self.layers = torch.nn.ModuleList(Layer(reduce) for _ in range(n))

    def forward(self, ids, x):
        self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if cuda:
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.randn(a.tokens, a.hidden, device=dev).to(getattr(torch, a.dtype))
    const = lambda t: ("layers.0.o_proj", 0, "layer.0", "layers.0.o_proj")  # noqa: E731
    events: list = []

    def after(rec, out):
        if cuda:
            ev = torch.cuda.Event()
            ev.record(current_stream(out.get_device()))
            events.append((rec.seq, ev))

    fp = Deferred(0x7470, 32)
    ids = torch.zeros(a.tokens, dtype=torch.long, device=dev)
    models = {r: Model(a.per, r, a.hidden).to(dev) for r in (True, False)}

    def loop():
        for _ in range(a.per):
            dist.all_reduce(x)

    def timed(fn, enter=None):
        sync()
        if enter is not None:
            with enter():
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        sync()
        return t / a.per * 1e6

    def v_off():
        audit_mod.release()
        return timed(loop)

    def v_passthrough():
        audit_mod.sync()
        return timed(loop)

    def v_audit():
        return timed(loop, lambda: Audit(const))

    def v_audit_event():
        r = timed(loop, lambda: Audit(const, after=after))
        events.clear()
        return r

    def v_audit_fp():
        r = timed(loop, lambda: Audit(const, after=after, summarize=fp, keep=lambda w: False))
        fp.resolve()
        events.clear()
        return r

    def kernel_only(fn):
        # the same variant with ProcessGroup's doors closed: every collective through the kernel
        def v():
            audit_mod.sync()
            audit_mod.set_doors(False)
            try:
                return fn()
            finally:
                audit_mod.set_doors(True)
        return v

    def tap_run(reduce):
        m = models[reduce]
        sync()
        with Tap(m, keep=lambda n: False, keep_allreduce_tensors=False, progress=Progress(), embed="embed_tokens"):
            t0 = time.perf_counter()
            m(ids, x)
            t = time.perf_counter() - t0
        sync()
        return t

    def v_tap():
        return (tap_run(True) - tap_run(False)) / a.per * 1e6

    parts = {"Audit.begin": 0.0, "Tap._attribution": 0.0, "Audit.end": 0.0, "Tap._after_collective": 0.0}
    n_parts = [0]

    def timing(cls, name, key):
        f = getattr(cls, name)

        def g(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                parts[key] += time.perf_counter() - t0
        return f, g

    def tap_parts():
        # the Tap's per-collective parts, each timed by a wrapper around it (inner parts are inside
        # their callers: _attribution inside Audit.begin, _after_collective inside Audit.end)
        saved = []
        for cls, name, key in ((Audit, "begin", "Audit.begin"), (Tap, "_attribution", "Tap._attribution"),
                               (Audit, "end", "Audit.end"), (Tap, "_after_collective", "Tap._after_collective")):
            f, g = timing(cls, name, key)
            saved.append((cls, name, f))
            setattr(cls, name, g)
        try:
            tap_run(True)
        finally:
            for cls, name, f in saved:
                setattr(cls, name, f)
        n_parts[0] += a.per

    variants = {"off": v_off, "passthrough": v_passthrough, "audit": v_audit, "audit_event": v_audit_event,
                "audit_fp": v_audit_fp, "tap": v_tap, "passthrough_kernel": kernel_only(v_passthrough),
                "audit_event_kernel": kernel_only(v_audit_event), "tap_kernel": kernel_only(v_tap)}
    names = list(variants)
    for n in names * 3:
        variants[n]()
    res = {n: [] for n in names}
    for i in range(a.rounds):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            res[n].append(variants[n]())
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}), backend "
          f"{dist.get_backend()}, x {list(x.shape)} {x.dtype}, {a.per} collectives a round, {a.rounds} rounds")
    print(f"{'variant':14s} {'median us':>10s} {'mean us':>10s} {'minus previous':>15s}")
    prev = None
    for n in names:
        med = statistics.median(res[n])
        print(f"{n:14s} {med:10.1f} {statistics.mean(res[n]):10.1f} "
              f"{'' if prev is None or n.startswith('tap') or n.endswith('kernel') else f'{med - prev:+15.1f}'}")
        prev = med
    for _ in range(50):
        tap_parts()
    print("inside the tap's collective, us each (wrapped, so a little high): " +
          ", ".join(f"{k} {v / n_parts[0] * 1e6:.1f}" for k, v in parts.items()))
    if cuda:
        audit_mod.release()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        torch.cuda._sleep(10_000_000)
        s1.record()
        sync()
        cycles_per_ms = 10_000_000 / s0.elapsed_time(s1)
        idle, busy = [], []
        for _ in range(20):
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            idle.append(time.perf_counter() - t0)
            sync()
            torch.cuda._sleep(int(a.busy_ms * cycles_per_ms))
            t0 = time.perf_counter()
            dist.all_reduce(x)
            busy.append(time.perf_counter() - t0)
            sync()
        print(f"blocking? host us of one all_reduce: idle device {statistics.median(idle) * 1e6:.1f}, "
              f"behind {a.busy_ms} ms of queued work {statistics.median(busy) * 1e6:.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
