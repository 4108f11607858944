"""The zoo (tests/zoo/): TP models not shaped like the built-in one, probed with zero configuration.

Every healthy model must come out with complete coverage (embedding found, all 4 layers hooked,
reduces audited on every rank, every path readable) and zero findings; every model with one reduce
dropped must be named exactly: partial-allreduce at layer 2 and the module that issues the reduce,
on all ranks. A stale replicated parameter (an MoE router; a stale row-parallel bias is tested on
megatron-core itself, tests/libs/test_tp_libs.py) and a small drift on one rank (F21) must be named on
that rank; reduces through doors the audit cannot read (F20)
must be said.

To stay within CI time, one set of gloo ranks runs many probes: each case is `tpprobe.probe.pipeline.run`
exactly as a rank of `tpprobe probe` runs it (its own store prefix, the real exchange and checks),
on a process group kept between cases.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.helpers.ranks import spawn

ALL = "all"
DROPS = {  # model -> the module that issues layer 2's dropped reduce
    "gptj": "transformer.h.2",
    "aliased": "encoder.layers.2.mlp.dense_4h_to_h",
    "gptfast": "layers.2.feed_forward.w2",
    "seqpar": "blocks.2",
    "moe": "stack.2.moe",
    "fused": "decoder.2.mixer",
}


def _run_cases(rank, world, cases, root):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from tpprobe.probe.pipeline import ProbeOptions, run
    out = {}
    for i, (name, model, env, exchange) in enumerate(cases):
        os.environ["TORCHELASTIC_RUN_ID"] = f"zoo-{i}"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            code = run(ProbeOptions(model=model, layers=[-1, 0, 1], out=os.path.join(root, name), quiet=True,
                                    exchange=exchange, timeout=120), keep_group=True)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if rank == 0:
            with open(os.path.join(root, name, "report.json")) as f:
                rep = json.load(f)
            out[name] = {"code": code, "findings": rep["findings"], "coverage": rep.get("coverage", {}),
                         "checked": rep["allreduce"].get("checked"), "incomplete": rep["allreduce"].get("incomplete")}
    return out


def _probe_all(tmp_path, world, cases):
    return spawn(_run_cases, world, cases, str(tmp_path), timeout=600)[0]


def _got(res):
    return [(f["kind"], f["where"], f["ranks"]) for f in res["findings"] if f["severity"] == "failure"]


def _assert_healthy(name, res, world):
    cov = res["coverage"]
    assert res["code"] == 0 and res["findings"] == [], (name, res["findings"])
    assert cov["embed"] and cov["embed_how"] == "structure", (name, cov)
    assert cov["layers_found"] == cov["layers_ran"] == 4 and cov["layer_how"] == "structure", (name, cov)
    assert cov["unreadable_paths"] == {}, (name, cov)
    places = cov["reduces_per_place"]
    assert all(places.get(f"layer.{k}", {}).get(str(r), 0) >= 1 for k in range(4) for r in range(world)), (name, places)
    assert res["checked"] > 0 and res["incomplete"] == 0, (name, res)


def _cases(dtype, exchange="full"):
    env = {"ZOO_DTYPE": dtype}
    cases = [(f"{m}-healthy", f"tests.zoo.{m}:healthy", env, exchange) for m in DROPS]
    cases += [(f"{m}-drop", f"tests.zoo.{m}:drop", env, exchange) for m in DROPS]
    return cases


def _check_zoo(results, world):
    for m, module in DROPS.items():
        _assert_healthy(m, results[f"{m}-healthy"], world)
        res = results[f"{m}-drop"]
        assert res["code"] == 1, (m, res["findings"])
        assert _got(res) == [("partial-allreduce", f"layer 2 ({module})", list(range(world)))], (m, res["findings"])


def test_zoo_tp2_float32_plus_stale_params_drift_and_opaque_paths(tmp_path):
    """tp 2, fp32: the six shapes healthy and broken, a stale MoE router, F20 and F21."""
    f32 = {"ZOO_DTYPE": "float32"}
    bf16 = {"ZOO_DTYPE": "bfloat16"}
    extra = [
        ("moe-stale-router", "tests.zoo.moe:stale_router", f32, "full"),
        # F21: one rank's stream off by 1 % (bf16) / 0.1 % (fp32) from layer 2 on: a failure, never noise
        ("gptj-drift-bf16", "tests.zoo.gptj:nudge", {**bf16, "ZOO_SCALE": "1.01"}, "full"),
        ("gptj-drift-bf16-fp", "tests.zoo.gptj:nudge", {**bf16, "ZOO_SCALE": "1.01"}, "fingerprint"),
        # and 1 % in a random direction, judged on the k=32 sketch alone (layer 2 is not kept)
        ("gptj-noise-bf16-fp", "tests.zoo.drift:sweep", {**bf16, "ZOO_FAULT": "noise:0.01", "ZOO_RANK": "1",
                                                         "ZOO_LAYER": "2", "ZOO_SEED": "7"}, "fingerprint"),
        ("gptj-drift-fp32", "tests.zoo.gptj:nudge", {**f32, "ZOO_SCALE": "1.001"}, "full"),
        # F20: a reduce the audit can count but not read; a dropped one; no reduce visible at all
        ("opaque-custom-op", "tests.zoo.opaque:custom_op", f32, "full"),
        ("opaque-custom-op-drop", "tests.zoo.opaque:custom_op_drop", f32, "full"),
        ("opaque-p2p", "tests.zoo.opaque:p2p", f32, "full"),
    ]
    results = _probe_all(tmp_path, 2, _cases("float32") + extra)
    _check_zoo(results, 2)
    assert _got(results["moe-stale-router"]) == [("rank-divergence",
                                                  "layer 2 parameter stack.2.moe.router.weight", [1])]
    for name in ("gptj-drift-bf16", "gptj-drift-bf16-fp", "gptj-noise-bf16-fp", "gptj-drift-fp32"):
        assert _got(results[name]) == [("rank-divergence", "layer.2.out", [1])], (name, results[name]["findings"])
    op = results["opaque-custom-op"]
    assert op["code"] == 0 and [(f["kind"], f["severity"]) for f in op["findings"]] == [("coverage", "warning")]
    assert "tpzoo.custom_all_reduce" in op["findings"][0]["detail"]
    drop = results["opaque-custom-op-drop"]
    assert _got(drop) == [("partial-allreduce", "layer 2 (transformer.h.2)", [0, 1])], drop["findings"]
    p2p = results["opaque-p2p"]
    assert p2p["code"] == 1 and _got(p2p) == [("coverage", "collective audit", [0, 1])], p2p["findings"]


def test_zoo_tp4_bfloat16(tmp_path):
    """tp 4, bf16: the six shapes healthy and broken. (Full exchange: alternating fingerprint cases
    on one kept tp-4 group stalled ranks 2-3 after the first fingerprint case here — a multi-case
    harness issue not seen at tp 2 or in separate `tpprobe probe` runs; fingerprint mode is covered
    at tp 2 here, in test_noise_sweep.py and by `-m sweep`.)"""
    _check_zoo(_probe_all(tmp_path, 4, _cases("bfloat16")), 4)


@pytest.mark.sweep
@pytest.mark.parametrize("world,dtype,exchange", [(2, "bfloat16", "full"), (2, "float32", "fingerprint"),
                                                  (4, "float32", "full"), (4, "bfloat16", "fingerprint")])
def test_zoo_long(tmp_path, world, dtype, exchange):
    _check_zoo(_probe_all(tmp_path, world, _cases(dtype, exchange)), world)
