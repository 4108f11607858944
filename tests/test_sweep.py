"""Healthy sweep: no false alarms across seeds, dtypes, tp 2 and 4, layer id sets, 1 to 512 tokens.

The whole sweep (56 runs) is `pytest -m sweep` (about 6 minutes on 2 cores); a representative
slice runs in the default suite.
"""
import itertools

import pytest

from tests.ranks import probe

ID_SETS = ["-1,1,3", "-1,2,4", "0,2", "1", "-1,0,1,2,3,4", "-1,4"]
TOKENS = [1, 3, 16, 64, 200, 512]


def configs():
    out = []
    for i, (nproc, dtype) in enumerate(itertools.product([2, 4], ["float32", "bfloat16"])):
        for j in range(14):
            seed = 14 * i + j
            out.append((nproc, dtype, seed, ID_SETS[seed % len(ID_SETS)], TOKENS[seed % len(TOKENS)],
                        "fingerprint" if seed % 3 == 0 else "full"))
    return out


ALL = configs()
SLICE = [ALL[1], ALL[19], ALL[33], ALL[50]]


def _id(c):
    return f"tp{c[0]}-{c[1]}-seed{c[2]}-ids{c[3]}-t{c[4]}-{c[5]}"


def _healthy(tmp_path, nproc, dtype, seed, ids, tokens, exchange):
    rc, rep, cp = probe(tmp_path / "r", "--dtype", dtype, "--seed", str(seed), "--layers", ids,
                        "--tokens", str(tokens), "--exchange", exchange, nproc=nproc)
    assert rc == 0, cp.stderr[-2000:]
    assert rep["findings"] == [], rep["findings"]


@pytest.mark.parametrize("cfg", SLICE, ids=_id)
def test_healthy_slice_has_zero_findings(tmp_path, cfg):
    _healthy(tmp_path, *cfg)


@pytest.mark.sweep
@pytest.mark.parametrize("cfg", ALL, ids=_id)
def test_healthy_sweep_has_zero_findings(tmp_path, cfg):
    _healthy(tmp_path, *cfg)
