"""The detection curve of the one noise model (docs/noise.md): the smallest relative error on one
rank that full mode (core.noise.compare on the tensors) and fingerprint mode (checks.evidence.
fp_level on the k=32 sketches) call material in >= 99 % of seeded trials, per dtype and fault shape;
and the largest 1-2 ULP rounding noise both still call noise.

    python bench/detection_curve.py [--tokens 64] [--hidden 512] [--trials 100] [--k 32]
    python bench/detection_curve.py --spread 2000 [--k 32]

--spread N: instead, the spread of the sketch's estimate of rel_norm (estimate / true value, bf16,
N seeded trials) for a 1 % error in a random direction and for 1 ULP on half the elements: the
quantiles noise.SKETCH_SLACK is set from. --k: sketch entries (the probe uses PROBE_K = 32; the
kernels take up to 64), to see what a larger sketch would buy.
"""
from __future__ import annotations

import argparse

import torch

from tpprobe.fingerprint.levels import fp_level, fp_rel
from tpprobe.core.noise import compare
from tpprobe.fingerprint.reference import PROBE_K, PROBE_SEED, fingerprint

GRID = [2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 1.5e-2, 2e-2, 5e-2, 1e-1, 0.3, 1.0, 3.0]


def fault(x: torch.Tensor, kind: str, rel: float, g: torch.Generator) -> torch.Tensor:
    y = x.double().clone()
    if kind == "scale":
        y *= 1 + rel
    elif kind == "noise":
        n = torch.randn(y.shape, generator=g, dtype=torch.float64)
        y += n * (rel * y.norm() / n.norm())
    elif kind == "tokens 1/8":
        y[: max(1, y.shape[0] // 8)] *= 1 + rel
    elif kind == "one element":     # one element off by rel x the tensor's RMS
        i = int(torch.randint(0, y.numel(), (1,), generator=g))
        y.view(-1)[i] += rel * float(y.pow(2).mean().sqrt())
    elif kind == "1 ULP on 1/2":   # reduction-order noise: about half the elements round the other way
        up = torch.nextafter(x, torch.full_like(x, float("inf")))
        return torch.where(torch.rand(x.shape, generator=g) < 0.5, up, x)
    elif kind == "1-2 ULP":     # every element moved 1 or 2 ULP (rel unused)
        up = torch.nextafter(x, torch.full_like(x, float("inf")))
        two = torch.nextafter(up, torch.full_like(x, float("inf")))
        return torch.where(torch.rand(x.shape, generator=g) < 0.5, up, two)
    return y.to(x.dtype)


def detected(x, y, dtype, k=PROBE_K):
    full = compare(y, x, dtype=dtype)["level"] == "material"
    fa, fb = fingerprint(y, seed=PROBE_SEED, k=k), fingerprint(x, seed=PROBE_SEED, k=k)
    return full, fp_level(fa, fb, dtype) == "material"


def spread(a) -> None:
    dtype = torch.bfloat16
    print(f"tensor [{a.tokens}, {a.hidden}] bf16, k={a.k}, {a.spread} seeded trials: the sketch's estimate "
          f"of rel_norm / the true rel_norm")
    for kind, rel in (("noise", 1e-2), ("1 ULP on 1/2", 0.0)):
        r = []
        for t in range(a.spread):
            g = torch.Generator().manual_seed(1000 * t + 7)
            x = (torch.randn(a.tokens, a.hidden, generator=g) * 2.0).to(dtype)
            y = fault(x, kind, rel, g)
            est = fp_rel(fingerprint(y, seed=PROBE_SEED, k=a.k), fingerprint(x, seed=PROBE_SEED, k=a.k))
            r.append(est / compare(y, x, dtype=dtype)["rel_norm"])
        q = torch.tensor(r).sort().values
        at = lambda p: float(q[min(len(q) - 1, int(p * len(q)))])  # noqa: E731
        print(f"{kind:12} " + "  ".join(f"q{p:g} {at(p):.3f}" for p in (0.001, 0.01, 0.5, 0.99, 0.999))
              + f"  sd {float(q.std()):.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--k", type=int, default=PROBE_K, help="sketch entries (the probe: PROBE_K)")
    ap.add_argument("--spread", type=int, default=0, help="trials: print the sketch estimate's spread instead")
    a = ap.parse_args()
    if a.spread:
        return spread(a)
    print(f"tensor [{a.tokens}, {a.hidden}], {a.trials} seeded trials per cell, k={a.k}; smallest relative error "
          f"detected in >= 99 % of trials (full | fingerprint)")
    print(f"{'dtype':9} {'fault':12} {'full':>9} {'fingerprint':>12}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kind in ("scale", "noise", "tokens 1/8", "one element", "1 ULP on 1/2", "1-2 ULP"):
            best = {"full": None, "fp": None}
            hits_noise = [0, 0]
            ulp = "ULP" in kind
            for rel in (GRID if not ulp else [0.0]):
                hit = [0, 0]
                for t in range(a.trials):
                    g = torch.Generator().manual_seed(1000 * t + 7)
                    x = (torch.randn(a.tokens, a.hidden, generator=g) * 2.0).to(dtype)
                    f, p = detected(x, fault(x, kind, rel, g), dtype, a.k)
                    hit[0] += f
                    hit[1] += p
                if ulp:
                    hits_noise = hit
                    break
                for i, key in enumerate(("full", "fp")):
                    if best[key] is None and hit[i] >= 0.99 * a.trials:
                        best[key] = rel
                if best["full"] is not None and best["fp"] is not None:
                    break
            name = str(dtype).removeprefix("torch.")
            if ulp:
                print(f"{name:9} {kind:12} {'noise' if hits_noise[0] == 0 else f'{hits_noise[0]} flagged':>9} "
                      f"{'noise' if hits_noise[1] == 0 else f'{hits_noise[1]} flagged':>12}")
            else:
                fmt = lambda v: "—" if v is None else f"{v:.0e}" if v < 1e-2 else f"{v:g}"  # noqa: E731
                print(f"{name:9} {kind:12} {fmt(best['full']):>9} {fmt(best['fp']):>12}")


if __name__ == "__main__":
    main()
