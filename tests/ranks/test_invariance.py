"""`tpprobe invariance`: real multi-rank runs (one launch of N gloo ranks per TP size), judged on
fingerprints of the prompt's own rows; every test asserts the exact first-breaking place.

Default run (CI): the ordered reduction is bitwise at tp 1,2 x batch 1,3; the default gloo path is
rounding noise, first broken at layer 0's o_proj all-reduce by the TP split (and, re-judged on the
same run's files, --expect noise passes where --expect bitwise fails); an injected size switch is
named at the first collective whose VALUES change (tp 4: a sum of two partials is the same in any
order, so a switch of summation order cannot show at tp 2); SGLang's Llama is batch-invariant at
tp 2; bad usage is one line, exit 2. `-m sweep`: the 1/2/4 x 1/3/8 grid, SGLang tp 1/2/4, a padded
--model factory, --keep.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_cli

H, F32 = 64, 4            # the built-in model's hidden size, float32 bytes
L = 6                     # its layers


def invariance(out: Path, *args: str, timeout: float = 300):
    cp = run_cli(["invariance", "--out", str(out), "--json", *args], timeout=timeout)
    rep = out / "report.json"
    assert rep.exists(), (cp.returncode, cp.stderr[-3000:])
    report = json.loads(rep.read_text())
    assert json.loads(cp.stdout)["exit_code"] == report["exit_code"] == cp.returncode, cp.stderr[-2000:]
    return cp.returncode, report


def builtin_rows(prefix: str = "") -> list[str]:
    rows = [f"{prefix}embed_tokens", "embed.out", "layer.0.in_norm"]
    for k in range(L):
        rows += [f"{prefix}layers.{k}.self_attn.o_proj", f"{prefix}layers.{k}.mlp.down_proj", f"layer.{k}.out"]
    return rows


def cfg(report: dict, name: str) -> dict:
    return next(c for c in report["configs"] if c["name"] == name)


def levels(report: dict, name: str) -> set:
    return {e["cells"][name]["level"] for e in report["rows"]}


def test_ordered_reduction_is_bitwise_at_tp_1_2_and_batch_1_3(tmp_path):
    code, rep = invariance(tmp_path / "o", "--tp", "1,2", "--batch", "1,3", "--reduce", "ordered")
    assert code == 0
    assert [e["key"] for e in rep["rows"]] == builtin_rows()           # full coverage, model order
    assert rep["verdict"]["status"] == "bitwise" and rep["verdict"]["line"].startswith("BITWISE: all 3")
    for name in ("tp1·b3", "tp2·b1", "tp2·b3"):
        assert cfg(rep, name)["level"] == "bitwise" and cfg(rep, name)["first_break"] is None
        assert levels(rep, name) == {"bitwise"}
    # the collectives really ran at tp 2 (gather + ordered sum), and compared their inputs per rank
    o_proj = next(e for e in rep["rows"] if e["key"] == "layers.0.self_attn.o_proj")
    assert o_proj["ops"]["tp1·b1"] is None
    assert o_proj["ops"]["tp2·b3"] in ("all_gather_single", "all_gather_into_tensor")
    assert o_proj["in_cells"]["tp2·b3"] == {"level": "bitwise", "vs": "tp2·b1"}
    assert cfg(rep, "tp2·b3")["lens"][cfg(rep, "tp2·b3")["prompt_index"]] == 16   # the prompt, among 3


def test_default_gloo_is_rounding_noise_first_broken_by_the_tp_split(tmp_path):
    code, rep = invariance(tmp_path / "d", "--tp", "1,2", "--batch", "1,3")   # --expect bitwise (default)
    assert code == 1
    assert [e["key"] for e in rep["rows"]] == builtin_rows()
    assert rep["verdict"]["status"] == "noise" and "NOT met by tp2·b1, tp2·b3" in rep["verdict"]["expect"]
    assert cfg(rep, "tp1·b3")["level"] == "bitwise" and cfg(rep, "tp1·b3")["first_break"] is None
    for name, batch in (("tp2·b1", 1), ("tp2·b3", 3)):
        c = cfg(rep, name)
        fb = c["first_break"]
        assert c["level"] == "noise" and levels(rep, name) == {"bitwise", "noise"}
        assert (fb["row"], fb["layer"], fb["cause"], fb["level"]) == ("layers.0.self_attn.o_proj", 0,
                                                                      "tp-split", "noise")
        assert fb["collective"]["op"] == "all_reduce" and fb["collective"]["shape"] == [sum(c["lens"]), H]
        assert fb["collective"]["bytes"] == sum(c["lens"]) * H * F32
        assert len(c["lens"]) == batch
        # everything before it is bitwise: the embedding's all-reduce adds zeros, the norm is replicated
        before = builtin_rows()[:builtin_rows().index(fb["row"])]
        assert all(e["cells"][name]["level"] == "bitwise" for e in rep["rows"] if e["key"] in before)
    # the same files, judged with --expect noise: exit 0 (a real run's fingerprints, re-compared)
    from tpprobe.probe.pipeline import ProbeOptions
    from tpprobe.invariance.compare import compare
    from tpprobe.invariance.options import InvarianceOptions
    runs = {tp: [json.loads((tmp_path / "d" / f"tp{tp}" / f"rank{r}.json").read_text()) for r in range(tp)]
            for tp in (1, 2)}
    again = compare(runs, InvarianceOptions(tp=[1, 2], batch=[1, 3], expect="noise", probe=ProbeOptions()))
    assert again["exit_code"] == 0 and again["verdict"]["expect"] == "--expect noise: met"


def test_injected_size_switch_is_named_at_the_first_collective_it_changes(tmp_path):
    # ordered below 8 KiB, the backend's all-reduce above: batch 1 (16 rows, 4 KiB) stays ordered,
    # batch 3 (61 rows, 15 KiB) switches every collective; the embedding's sum of zeros stays exact
    code, rep = invariance(tmp_path / "s", "--tp", "4", "--batch", "1,3", "--reduce", "ordered",
                           "--switch-above", "8192", "--reference", "tp4,b1")
    assert code == 1
    c = cfg(rep, "tp4·b3")
    fb = c["first_break"]
    assert (fb["row"], fb["layer"], fb["cause"], fb["level"]) == ("layers.0.self_attn.o_proj", 0,
                                                                  "collective-size", "noise")
    assert fb["collective"]["op"] == "all_reduce" and fb["collective"]["bytes"] == sum(c["lens"]) * H * F32 > 8192
    assert fb["compared_collective"]["op"] in ("all_gather_single", "all_gather_into_tensor")
    assert fb["compared_collective"]["bytes"] == 16 * H * F32 <= 8192
    emb = next(e for e in rep["rows"] if e["key"] == "embed_tokens")
    assert emb["ops"]["tp4·b3"] == "all_reduce" and emb["cells"]["tp4·b3"]["level"] == "bitwise"
    o_proj = next(e for e in rep["rows"] if e["key"] == fb["row"])
    assert o_proj["in_cells"]["tp4·b3"]["level"] == "bitwise"          # its inputs are equal on every rank
    assert "depends on its message size" in fb["line"] and "15.2 KiB" in fb["line"]


def test_sglang_llama_is_batch_invariant_at_tp2(tmp_path):
    code, rep = invariance(tmp_path / "g", "--engine", "sglang", "--arch", "llama", "--tp", "2",
                           "--batch", "1,3", "--reference", "tp2,b1", timeout=420)
    assert code == 0, rep["verdict"]
    keys = [e["key"] for e in rep["rows"]]
    assert keys == builtin_rows("model.")
    assert all(e["ops"]["tp2·b3"] == "all_reduce" for e in rep["rows"] if e["kind"] == "collective")
    assert levels(rep, "tp2·b3") == {"bitwise"} and rep["settings"]["layout"] == "packed"
    assert all(e["in_cells"]["tp2·b3"]["level"] == "bitwise" for e in rep["rows"] if e["in_cells"])


USAGE = {
    "tp-zero": (["--tp", "0,2"], "--tp '0,2': expected comma-separated positive integers"),
    "batch-repeat": (["--batch", "1,1"], "repeats a value"),
    "reference-format": (["--reference", "one"], "expected tpN,bM"),
    "reference-outside": (["--reference", "tp8,b1"], "is not in the grid"),
    "expect": (["--expect", "close"], "unknown --expect 'close'"),
    "one-config": (["--tp", "2", "--batch", "3"], "nothing to compare"),
    "switch-needs-ordered": (["--switch-above", "100"], "use it with --reduce ordered"),
    "reduce": (["--reduce", "fast"], "unknown --reduce 'fast'"),
    "ordered-tp3": (["--reduce", "ordered", "--tp", "1,3", "--heads", "6", "--hidden", "48", "--ffn", "96"],
                    "tp (3) must divide 8"),
    "reduce-on-sglang": (["--engine", "sglang", "--reduce", "ordered"], "drop them with --model or --engine sglang"),
}


def test_a_factory_that_cannot_be_imported_is_one_line_from_the_ranks(tmp_path):
    cp = run_cli(["invariance", "--out", str(tmp_path / "m"), "--tp", "1", "--batch", "1,3", "--timeout", "20",
                  "--model", "tests.no_such_module:build"], timeout=120)
    lines = cp.stderr.strip("\n").splitlines()
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("tpprobe: error: --model tests.no_such_module:build: cannot import")


@pytest.mark.parametrize("name", list(USAGE))
def test_bad_usage_is_one_line_exit_2(tmp_path, name):
    from tests.ranks.test_cli_usage import _fork_cli
    args, want = USAGE[name]
    p = _fork_cli(["invariance", "--out", str(tmp_path / "never"), *args], tmp_path)
    lines = p.stderr.strip("\n").splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and lines[0].startswith("tpprobe: error: ") and want in lines[0], lines
    assert not (tmp_path / "never").exists()


# ---- the long runs (-m sweep) ------------------------------------------------------------------
@pytest.mark.sweep
def test_sweep_ordered_bitwise_on_the_whole_grid(tmp_path):
    code, rep = invariance(tmp_path / "o", "--tp", "1,2,4", "--batch", "1,3,8", "--reduce", "ordered", timeout=600)
    assert code == 0 and rep["verdict"]["status"] == "bitwise"
    assert len(rep["configs"]) == 9 and [e["key"] for e in rep["rows"]] == builtin_rows()
    assert all(c["first_break"] is None for c in rep["configs"])


@pytest.mark.sweep
def test_sweep_default_gloo_noise_on_the_whole_grid(tmp_path):
    code, rep = invariance(tmp_path / "d", "--tp", "1,2,4", "--batch", "1,3,8", "--expect", "noise", timeout=600)
    assert code == 0 and rep["verdict"]["status"] == "noise"
    for c in rep["configs"]:
        if c["tp"] == 1:
            assert c["level"] in ("reference", "bitwise"), c
            continue
        fb = c["first_break"]
        assert c["level"] == "noise" and fb["row"] == "layers.0.self_attn.o_proj" and fb["layer"] == 0
        assert fb["cause"] in ("tp-split", "collective-size") and fb["collective"]["op"] == "all_reduce"


@pytest.mark.sweep
def test_sweep_sglang_grid(tmp_path):
    code, rep = invariance(tmp_path / "g", "--engine", "sglang", "--arch", "llama", "--tp", "1,2,4",
                           "--batch", "1,3,8", "--expect", "noise", timeout=900)
    assert code == 0 and [e["key"] for e in rep["rows"]] == builtin_rows("model.")
    for c in rep["configs"]:
        if c["tp"] > 1:
            assert c["first_break"]["row"] == "model.layers.0.self_attn.o_proj"


@pytest.mark.sweep
def test_sweep_padded_model_factory_and_keep(tmp_path):
    code, rep = invariance(tmp_path / "m", "--model", "examples.my_model:build", "--tp", "1,2", "--batch", "1,3",
                           "--keep")
    assert code == 1 and rep["settings"]["layout"] == "padded"
    assert [e["key"] for e in rep["rows"]] == ["embed_tokens", "embed.out", "layers.0", "layer.0.out",
                                                "layers.1", "layer.1.out"]
    fb = cfg(rep, "tp2·b3")["first_break"]
    assert (fb["row"], fb["cause"], fb["collective"]["shape"][0]) == ("layers.0", "tp-split", 3)
    kept = rep["kept"]
    assert kept["cells"] > 0 and all(Path(f).exists() for f in kept["files"])
    assert not list((tmp_path / "m").glob("tp*/rank*.safetensors"))     # the bitwise rest is gone
    cell = next(e for e in rep["rows"] if e["key"] == "layers.0")["cells"]["tp2·b1"]
    assert cell["level"] == "noise" and 0 < cell["ulp_max"] < 64
