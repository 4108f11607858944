"""The host side of a fused fingerprint launch (fingerprint/triton/batch.py `Batch`, used by
`Deferred`): the same fingerprints, bit for bit, as the launch path it replaced, for less host
time per launch (docs/benchmarks.md has the H200 numbers); and the same, bit for bit, whether a
forward's partials are combined on the device (`_combine_kernel`) or on the host (`combine_many`,
which a CUDA-graph tap uses after replay; bench/fp_small.py times both).

Without a GPU the kernels run in Triton's CPU interpreter (tests/helpers/fp_interp.py, a subprocess:
TRITON_INTERPRET must be set before triton imports): every kernel branch at small shapes, each
shape twice (the cached entry), buffers small enough that a batch spills into several, NaN / Inf.
tests/unit/test_kernel_compile.py checks that the direct launch hands Triton's launcher exactly what
JITFunction.run binds.  The GPU tests (`-m gpu`, tests/unit/test_fingerprint.py) run `fingerprints`,
which is this path, against the torch path.
"""
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tpprobe.fingerprint import reference as FP
from tpprobe.fingerprint.reference import Deferred, Fingerprint, resolved

ROOT = Path(__file__).resolve().parents[2]


def test_batched_launches_equal_the_replaced_path_bit_for_bit_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is pinned in ci/sglang-cpu; CI installs it")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "fp_interp.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] == 22 and got["entries"] == 11 and got["buffers"] >= 2, got
    assert got["same"] == [True] * 22
    assert got["torch_ok"] == [True] * 22
    # the batch combined on the device (_combine_kernel), to the bit what the host combine gives:
    # every tensor above and fp32 with NaN / Inf, a partial read, and made-up partials whose float
    # sums depend on the order (9 to 397 programs, -0.0, NaN, Inf; bitmaps of up to 2100 rows)
    assert got["device_combine"] is True
    assert got["dev_eq_host"] == [True] * 25
    assert got["only_eq"] is True
    # launches made by the read (a tensor the Tap owns: take(later=True)), whole and partial reads
    assert got["later"] is True and got["later_partial"] is True
    assert got["synthetic"] == [True] * 5


def test_to_json_is_asdict_with_non_finite_floats_as_strings():
    fp = Fingerprint(shape=[3, 128], dtype="bfloat16", bit_hash="ab" * 16, sketch=[1.5, -math.inf, 0.0],
                     sumsq=math.nan, absmax=math.inf, n_nan=2, n_inf=1, row_nonzero="05", seed=7)
    want = asdict(fp)
    want.update(sumsq="nan", absmax="inf", sketch=[1.5, "-inf", 0.0])
    assert json.dumps(fp.to_json()) == json.dumps(want)          # same keys, same order
    back = Fingerprint.from_json(fp.to_json())
    assert back.sketch[:1] == [1.5] and math.isnan(back.sumsq) and back.absmax == math.inf


def test_deferred_reads_the_environment_once_at_its_first_cuda_tensor(monkeypatch):
    """CPU tensors never start a batch (a CPU run never imports triton for fingerprints); the
    torch-path switch is read when the first CUDA tensor comes, not per tensor."""
    d = Deferred(5, 16)
    t = torch.randn(4, 128)
    assert d(t) == FP._fingerprint_torch(t, 5, 16) and d.batch is None
    monkeypatch.setenv("TPPROBE_FINGERPRINT_TORCH", "1")
    monkeypatch.setattr(FP, "TORCH_PATH", {})
    assert d._start() is False and d.why == "TPPROBE_FINGERPRINT_TORCH is set"
    d.resolve()                          # nothing queued: nothing read, no error
    d.drop()
    assert resolved(d(t)).bit_hash == FP.fingerprint(t, 5, 16).bit_hash


def test_the_report_says_why_fingerprints_were_combined_on_the_host(monkeypatch):
    """TPPROBE_FP_HOST_COMBINE, or a device combine that failed once, is said per rank in the
    report's exchange part (as the torch path's reasons are); nothing is said otherwise, and a run
    that never imported the kernels says nothing."""
    import sys as _sys
    from tpprobe.capture.record import fingerprint_notes
    from tpprobe.fingerprint import triton as tf
    from tpprobe.exchange.gather import exchange_summary

    class Ch:
        def collect(self, key, deadline):
            return {0: 1, 1: 1}

    def metas(device):
        out = {}
        for r in (0, 1):
            out[r] = {"meta": {"device": device, "allreduces": [], "fingerprints": {}, **fingerprint_notes(device)}}
        return out

    monkeypatch.delenv("TPPROBE_FP_HOST_COMBINE", raising=False)
    monkeypatch.setattr(tf.STATE, "combine_why", [])
    assert "fingerprint_host_combine" not in exchange_summary("fingerprint", Ch(), metas("cuda:0"), {}, 0)
    monkeypatch.setenv("TPPROBE_FP_HOST_COMBINE", "1")
    monkeypatch.setattr(tf.STATE, "combine_why",
                        ["device combine unavailable (RuntimeError: x); combining on the host"])
    got = exchange_summary("fingerprint", Ch(), metas("cuda:0"), {}, 0)["fingerprint_host_combine"]
    assert got == {r: ["TPPROBE_FP_HOST_COMBINE is set",
                       "device combine unavailable (RuntimeError: x); combining on the host"] for r in (0, 1)}
    assert "fingerprint_host_combine" not in exchange_summary("fingerprint", Ch(), metas("cpu"), {}, 0)
    monkeypatch.delitem(_sys.modules, "tpprobe.fingerprint.triton.state")
    assert FP.host_combine_notes() == []
