"""GPU parity of the fused Triton fingerprint against the PyTorch path on the same CUDA tensor,
for each kernel variant (default, lane32, intstats): identical hash, counts, row bitmap, absmax,
sumsq to 1e-5, sketch to 2e-6 of the norm; NaN/Inf data too. Exit 1 on any mismatch.

    python3 bench/fingerprint_parity_gpu.py

(tests/test_fingerprint.py's GPU tests also compare with the CPU path, whose hash is blake2b
since 07ea906, so they cannot pass on CUDA until they compare with the CUDA torch path.)
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import tpprobe._triton_fingerprint as tf  # noqa: E402
from tpprobe.fingerprint import _fingerprint_torch  # noqa: E402

bad = 0
for variant in ({}, {"lane32": True}, {"intstats": True}, {"intstats": True, "lane32": True}):
    n = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for shape in [(8192, 7168), (64, 256), (300, 130), (5, 100), (3, 7, 8), (1, 2), (256, 512)]:
            g = torch.Generator(device="cuda").manual_seed(shape[0])
            t = (torch.randn(*shape, device="cuda", generator=g) * 2).to(dt)
            if t.dim() == 2 and shape[0] > 8:
                t[3] = 0
                t[7, -1] = -0.0
            if shape == (256, 512):
                t[1, 2], t[3, 4], t[5, 6] = float("nan"), float("inf"), -float("inf")
            if not tf.supported(t):
                continue
            for k in (16, 32, 64):
                f = tf.fingerprint_batch([t], seed=11, k=k, **variant)[0]
                r = _fingerprint_torch(t, 11, k)
                ok = (f.bit_hash == r.bit_hash and (f.n_nan, f.n_inf, f.row_nonzero, f.shape, f.dtype)
                      == (r.n_nan, r.n_inf, r.row_nonzero, r.shape, r.dtype) and f.absmax == r.absmax
                      and (f.sumsq == r.sumsq or abs(f.sumsq - r.sumsq) <= 1e-5 * abs(r.sumsq))
                      and (not math.isfinite(r.sumsq)   # NaN/Inf data: the sketch is not compared
                           or max(abs(a - b) for a, b in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq)))
                n += 1
                if not ok:
                    bad += 1
                    print("MISMATCH", variant, dt, shape, k, f.bit_hash == r.bit_hash, (f.n_nan, r.n_nan),
                          (f.n_inf, r.n_inf), (f.absmax, r.absmax), f.row_nonzero == r.row_nonzero)
    print("parity", variant or "default", "cases", n, "ok" if not bad else f"{bad} bad so far")
sys.exit(1 if bad else 0)
