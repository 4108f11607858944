"""Run by tests/test_fingerprint_host.py under Triton's CPU interpreter (TRITON_INTERPRET=1, set
before triton imports): every launch of a `_triton_fingerprint.Batch` (the probe's path) against
the launch path it replaced (bench/_fp_old_launch.py, frozen), on the same kernels, bit for bit;
and both against the torch reference where the hashes are comparable.  Prints one JSON line."""
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import _interp_shim  # noqa: E402

_interp_shim.install()

import tpprobe.exchange._triton_fingerprint as tf  # noqa: E402
from bench import _fp_old_launch as old  # noqa: E402
from tpprobe.exchange.fingerprint import Pending, _fingerprint_torch  # noqa: E402

# (shape, dtype) of every kernel branch at small sizes: full tiles and the masked tail, one and
# several programs, token flags (width k * 128) and torch-side row flags (other widths), 1-D / 3-D
CASES = [((1, 128), torch.bfloat16), ((3, 384), torch.float16), ((17, 256), torch.bfloat16),
         ((33, 130), torch.bfloat16), ((5, 100), torch.float16), ((2, 3, 128), torch.bfloat16),
         ((6,), torch.float16), ((64, 256), torch.bfloat16), ((9, 128), torch.float32),
         ((5, 100), torch.float32), ((40, 128), torch.float32)]


def main():
    assert tf._INTERP, "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(7)
    tensors = []
    for rep in range(2):                 # each shape twice: the second launch reuses its entry
        for shape, dt in CASES:
            t = (torch.randn(*shape, generator=g) * 3).to(dt)
            if t.dim() == 2 and t.shape[0] > 2:
                t[1] = 0                 # an all-zero token row
            if rep and dt != torch.float32 and t.dim() == 2 and t.shape[0] > 3:
                t[2, 1], t[3, 0] = float("nan"), float("inf")      # the host's exact counts
            tensors.append(t)
    tf.Batch.CHUNK = 256                 # small buffers: a batch spills into several (the cat path)
    b = tf.Batch(3, 32)
    tags = [Pending() for _ in tensors]
    assert all(b.add(t, ph) for t, ph in zip(tensors, tags))
    nbuf = len(b.chunks)
    b.read()
    new = [ph.fp for ph in tags]
    ref = []
    for t in tensors:                    # the frozen path's launch and combine, per tensor
        fin, _ = old.launch([t], 3, 32)
        ref.append(fin()[0])
    same = [a.to_json() == r.to_json() for a, r in zip(new, ref)]
    torch_ok = []
    for t, f in zip(tensors, new):       # the CPU reference hashes with blake2b: the rest agrees
        r = _fingerprint_torch(t, 3, 32)
        finite = not (r.n_nan or r.n_inf)
        torch_ok.append(f.row_nonzero == r.row_nonzero and (f.n_nan, f.n_inf) == (r.n_nan, r.n_inf)
                        and f.absmax == r.absmax and (not finite or (
                            abs(f.sumsq - r.sumsq) <= 1e-5 * r.sumsq
                            and max(abs(x - y) for x, y in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq))))
    print(json.dumps({"n": len(tensors), "buffers": nbuf, "same": same, "torch_ok": torch_ok,
                      "entries": len(b.entries)}))


if __name__ == "__main__":
    main()
