"""Run by tests/unit/test_fingerprint_host.py under Triton's CPU interpreter (TRITON_INTERPRET=1, set
before triton imports): every launch of a `fingerprint.triton.Batch` (the probe's path) against
the fingerprints the launch path it replaced gave on the same kernels and tensors, bit for bit
(tests/assets/fp_interp_golden.json, written by that path before it was removed; git keeps it);
and against the torch reference where the hashes are comparable.  Prints one JSON line."""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

sys.path.insert(0, HERE)
import interp_shim  # noqa: E402

interp_shim.install()

import tpprobe.fingerprint.triton as tf  # noqa: E402
from tpprobe.fingerprint.triton import kernels  # noqa: E402
from tpprobe.fingerprint.reference import Pending, _fingerprint_torch  # noqa: E402

# (shape, dtype) of every kernel branch at small sizes: full tiles and the masked tail, one and
# several programs, token flags (width k * 128) and torch-side row flags (other widths), 1-D / 3-D
CASES = [((1, 128), torch.bfloat16), ((3, 384), torch.float16), ((17, 256), torch.bfloat16),
         ((33, 130), torch.bfloat16), ((5, 100), torch.float16), ((2, 3, 128), torch.bfloat16),
         ((6,), torch.float16), ((64, 256), torch.bfloat16), ((9, 128), torch.float32),
         ((5, 100), torch.float32), ((40, 128), torch.float32)]


GOLDEN = os.path.join(ROOT, "tests", "assets", "fp_interp_golden.json")


def make_tensors(g) -> list:
    tensors = []
    for rep in range(2):                 # each shape twice: the second launch reuses its entry
        for shape, dt in CASES:
            t = (torch.randn(*shape, generator=g) * 3).to(dt)
            if t.dim() == 2 and t.shape[0] > 2:
                t[1] = 0                 # an all-zero token row
            if rep and dt != torch.float32 and t.dim() == 2 and t.shape[0] > 3:
                t[2, 1], t[3, 0] = float("nan"), float("inf")      # the host's exact counts
            tensors.append(t)
    return tensors


def main():
    assert kernels.INTERP, "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(7)
    tensors = make_tensors(g)
    tf.Batch.CHUNK = 256                 # small buffers: a batch spills into several (the cat path)
    b = tf.Batch(3, 32)
    tags = [Pending() for _ in tensors]
    assert all(b.add(t, ph) for t, ph in zip(tensors, tags))
    nbuf = len(b.chunks)
    b.read()
    new = [ph.fp for ph in tags]
    with open(GOLDEN) as f:              # the replaced path's launch and combine, per tensor
        ref = json.load(f)
    same = [_same(a, r, t.dtype) for a, r, t in zip(new, ref, tensors)] + [False] * (len(new) - len(ref))
    torch_ok = []
    for t, f in zip(tensors, new):       # the CPU reference hashes with blake2b: the rest agrees
        r = _fingerprint_torch(t, 3, 32)
        finite = not (r.n_nan or r.n_inf)
        torch_ok.append(f.row_nonzero == r.row_nonzero and (f.n_nan, f.n_inf) == (r.n_nan, r.n_inf)
                        and f.absmax == r.absmax and (not finite or (
                            abs(f.sumsq - r.sumsq) <= 1e-5 * r.sumsq
                            and max(abs(x - y) for x, y in zip(f.sketch, r.sketch)) <= 2e-6 * math.sqrt(r.sumsq))))
    entries = len(b.entries)
    dev_host = device_vs_host(tensors, new, g)
    print(json.dumps({"n": len(tensors), "buffers": nbuf, "same": same, "torch_ok": torch_ok,
                      "entries": entries, "device_combine": not b.host_combine and not tf.STATE.combine_why,
                      **dev_host, **later_reads(tensors, new), "synthetic": synthetic(g)}))


def later_reads(tensors, new) -> dict:
    """Every other tensor's launch made by the read (``take(later=True)``), over several buffers:
    the fingerprints of the batch above, to the bit; a partial read makes only the wanted launches."""
    out = {}
    for part in (False, True):
        b = tf.Batch(3, 32)
        items = [b.take(t, later=i % 2 == 1) for i, t in enumerate(tensors)]
        queued = len(b.later)
        wanted = [i for i in range(len(tensors)) if not part or i % 3 == 0]
        b.read({id(items[i]) for i in wanted} if part else None)
        got = [None if it.fp is None else _js(it.fp) for it in items]
        out["later_partial" if part else "later"] = (
            queued == len(tensors) // 2 and not b.later and [i for i, v in enumerate(got) if v] == wanted
            and all(got[i] == _js(new[i]) for i in wanted))
    return out


def _same(fp, ref: dict, dtype) -> bool:
    """Bit for bit, except an fp32 tensor's float sums (sketch, sumsq): under the interpreter numpy
    adds them in an order its SIMD dispatch picks for the host CPU (the golden was written on another
    machine: an AVX-512 host differs from it in the last bits of those sums, seen here). Those are
    held to a few fp32 ULPs of the tensor's scale; the hashes, counts, absmax and flags stay exact."""
    got = json.loads(_js(fp))
    if dtype != torch.float32 or not all(isinstance(got.get(k), (list, float)) for k in ("sketch", "sumsq")):
        return json.dumps(got) == json.dumps(ref)
    floats = ("sketch", "sumsq")
    if {k: v for k, v in got.items() if k not in floats} != {k: v for k, v in ref.items() if k not in floats}:
        return False
    scale = math.sqrt(abs(ref["sumsq"])) or 1.0
    ulps = 8 * 2.0 ** -23
    return (abs(got["sumsq"] - ref["sumsq"]) <= ulps * abs(ref["sumsq"]) and len(got["sketch"]) == len(ref["sketch"])
            and all(abs(x - y) <= ulps * scale for x, y in zip(got["sketch"], ref["sketch"])))


def _js(fp) -> str:
    return json.dumps(fp.to_json())      # strict: -0.0, nan and inf spelled out


def _read(tensors, host_combine: bool, only=None):
    b = tf.Batch(3, 32, host_combine=host_combine)
    tags = [Pending() for _ in tensors]
    assert all(b.add(t, ph) for t, ph in zip(tensors, tags))
    b.read(None if only is None else {id(tags[i]) for i in only})
    return [None if ph.fp is None else _js(ph.fp) for ph in tags]


def device_vs_host(tensors, new, g) -> dict:
    """The device combine (_combine_kernel; ``new``: the batch above) against the host combine
    (combine_many), to the bit: the tensors above (several per shape, several shapes, token flags
    and torch-side row flags, NaN / Inf in 16-bit), fp32 with NaN / Inf; a partial read (``only``)."""
    more = []
    for shape in [(9, 128), (5, 100), (3, 256)]:
        t = torch.randn(*shape, generator=g)
        t[1, 3], t[2, 0], t[0, 1] = float("nan"), float("inf"), -float("inf")
        more.append(t)
    eq = [_js(a) == b for a, b in zip(new, _read(tensors, True))]
    eq += [a == b for a, b in zip(_read(more, False), _read(more, True))]
    ts = tensors[:len(CASES)]
    only = list(range(0, len(ts), 3))
    part_dev, part_host = _read(ts, False, only), _read(ts, True, only)
    return {"dev_eq_host": eq, "only_eq": part_dev == part_host and [i for i, v in enumerate(part_dev) if v] == only
            and all(part_dev[i] == _js(new[i]) for i in only)}


def synthetic(g) -> list:
    """Partials made up to make the order of the float sums matter (exponents over 2^-30..2^30,
    -0.0, NaN, Inf), for program counts the interpreter's small grid never reaches (9 to 397) and
    token bitmaps of 1 to 2100 rows: the device combine against the host combine, to the bit."""
    cases = [(9, torch.bfloat16, (16, 1024)), (64, torch.float32, (3000,)), (397, torch.float16, (2100, 128)),
             (33, torch.float32, (1, 128)), (200, torch.bfloat16, (1025, 256))]
    ents, off, rng = [], 0, torch.Generator().manual_seed(11)
    for n, dt, shape in cases:
        p = tf.plan_one(shape, dt, "cpu", 32, 0, 0, 0, tf.tuning())
        p["nprog"] = n
        ntok = shape[0] if p["flags"] else 0
        e = tf.Entry(p=p, ni=4 * n, nf=(-(-n * (p["kp"] + 2) // 4) * 4 + 1) // 2, nprog=n, kp=p["kp"], ntok=ntok)
        e.words = e.ni + e.nf + (ntok + 1) // 2 + 1
        ents.append((e, off))
        off += e.words + (e.words % 2)
    buf = torch.zeros(off, dtype=torch.int64)
    for i, (e, o) in enumerate(ents):
        n, kp = e.p["nprog"], e.p["kp"]
        ip = buf[o:o + e.ni].view(n, 4)
        ip[:, :2] = torch.randint(0, 2 ** 32, (n, 2), generator=rng)
        ip[:, 2:] = torch.randint(0, 5, (n, 2), generator=rng)
        fp = buf[o + e.ni:o + e.ni + e.nf].view(torch.float32)[:n * (kp + 2)].view(n, kp + 2)
        scale = torch.exp2(torch.randint(-30, 30, (n, kp + 2), generator=rng).float())
        fp[:] = torch.randn(n, kp + 2, generator=rng) * scale
        fp[:, kp:] = fp[:, kp:].abs()
        fp[::7, 2] = -0.0
        fp[:, 5] = -0.0                   # a column of -0.0 only: its sum is -0.0
        if i == 1:
            fp[3, kp], fp[5, kp + 1], fp[6, 0] = float("nan"), float("inf"), float("-inf")
        if i == 3:
            fp[7, kp + 1] = float("nan")
        if e.ntok:
            buf[o + e.ni + e.nf:].view(torch.int32)[:e.ntok] = (torch.rand(e.ntok, generator=rng) < 0.5).int()
    out = []
    for host_combine in (False, True):
        b = tf.Batch(3, 32, host_combine=host_combine)
        b.chunks, b.used = [[buf, off]], off
        tags = [Pending() for _ in ents]
        b.items = [tf.Item(ph, e, 0, o, None, None) for ph, (e, o) in zip(tags, ents)]
        b.read()
        out.append([_js(ph.fp) for ph in tags])
    return [a == b for a, b in zip(*out)]


if __name__ == "__main__":
    main()
