"""--exchange fingerprint: the same findings as the full gather on every catalogue fault, for a
few KB per capture.

The expectations are the same table test_faults.py asserts for `--exchange full`, so a case
passing in both files proves the two protocols name the same fault at the same place and ranks.
"""
import pytest

from tests.helpers.ranks import failures, probe
from tests.ranks.test_faults import CASES


@pytest.mark.parametrize("inject,nproc,extra,kind,where,ranks", CASES, ids=[f"{c[0]}-tp{c[1]}" for c in CASES])
def test_fingerprint_exchange_names_the_same_fault_as_the_full_gather(tmp_path, inject, nproc, extra, kind,
                                                                      where, ranks):
    rc, rep, cp = probe(tmp_path / "r", "--exchange", "fingerprint", "--inject", inject, *extra, nproc=nproc)
    assert rc == 1, cp.stderr[-3000:]
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)] == [(kind, where, ranks)], rep["findings"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fingerprint_exchange_calls_one_ulp_noise(tmp_path, dtype):
    rc, rep, _ = probe(tmp_path / "r", "--exchange", "fingerprint", "--inject", "rank-noise@1", "--dtype", dtype)
    assert rc == 0 and [f["kind"] for f in rep["findings"]] == ["rounding-noise"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_healthy_fingerprint_exchange_moves_no_tensor_and_little_metadata(tmp_path, nproc):
    # a wider capture so that the bound is about the protocol, not fixed-size metadata
    rc, rep, _ = probe(tmp_path / "r", "--exchange", "fingerprint", "--hidden", "512", "--tokens", "256",
                       "--num-layers", "4", "--layers", "-1,1,2", nproc=nproc)
    assert rc == 0 and rep["findings"] == []
    captured = 256 * 512 * 4 * (2 + 4)        # fp32: embedding, local share and 4 layer streams
    for r, b in rep["exchange"]["bytes_per_rank"].items():
        assert b["tensor_sent"] == b["tensor_received"] == 0
        # each rank posts its metadata (fingerprints: a few KB per point) and reads the others'
        assert b["sent"] < 0.02 * captured, (r, b)


@pytest.mark.parametrize("inject", ["capture-offset", "skip-allreduce@2"])
def test_offline_report_of_a_fingerprint_capture_names_the_same_fault(tmp_path, inject):
    import json

    from tests.helpers.ranks import run_cli
    rc, rep, _ = probe(tmp_path / "r", "--exchange", "fingerprint", "--inject", inject)
    cp = run_cli(["report", str(tmp_path / "r"), "--json"])
    assert cp.returncode == rc == 1
    live = [(f["kind"], f["where"], f["ranks"]) for f in failures(rep)]
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures(json.loads(cp.stdout))] == live
