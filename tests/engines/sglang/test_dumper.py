"""`tpprobe report` / `tpprobe diff` / `--emit-dims` on folders written by SGLang's own dumper.

The folders come from `sglang.srt.debug_utils.dumper.dumper` on real gloo ranks with SGLang's
parallel state published (tests/helpers/dumper_ranks.py): a tp=2 run of several experiments and a tp=1
baseline, built once, concurrently. The CLI runs in this interpreter (main(), exit status caught).
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks

pytest.importorskip("sglang.srt.debug_utils.dumper")


def S(n, recs):
    return {"tokens": n, "records": recs}


HEALTHY = [("input_ids", "input_ids", None), ("embed", "embed", "t h # tp:replicated"), ("h", "full", None),
           ("o_proj", "row_part", "t h[tp:partial]"), ("qkv", "shard", "t h[tp]"), ("hidden_out", "row_full", None)]
TARGET = [("input_ids", "input_ids", None), ("embed", "embed_part", None), ("o_proj", "row_part", "t h[tp:partial]"),
          ("qkv", "shard", None), ("h", "full", None)]
TP2 = {
    "healthy": [S(8, HEALTHY), S(8, HEALTHY)],
    "noise": [S(16, [("h", "ulp", None)])],
    "pe_repl": [S(16, [("input_ids", "input_ids", None), ("embed", "embed_part", "t h # tp:replicated")])],
    "pe_bare": [S(16, [("embed", "embed_part", None)])],
    "row_sum": [S(16, [("o_proj", "row_part", None), ("hidden_out", "row_full", None)])],
    "scale": [S(16, [("h", "scale", None)])],
    "sliced": [S(16, [("h", "full", None), ("qkv", "shard", None)])],
    "twice": [S(16, [("h", "full", "t h[tp:partial]")])],
    "nan": [S(16, [("h", "nan", None)])],
    "tgt": [S(8, TARGET), S(8, TARGET)],                       # same tokens as the tp=1 base, two steps of 8
    "tgt_bad": [S(16, TARGET[:4] + [("h", "bump", None)])],
}
TP1 = {"base": [S(16, [("input_ids", "input_ids", None), ("embed", "embed", None), ("o_proj", "row_full", None),
                       ("qkv", "full", None), ("h", "full", None)])]}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    with ThreadPoolExecutor(2) as ex:
        jobs = [ex.submit(run_ranks, "tests.helpers.dumper_ranks:write", w, {"base": str(root / f"tp{w}"), "exps": e},
                          240)
                for w, e in ((2, TP2), (1, TP1))]
        for j in jobs:
            j.result()
    return root


def cli(*argv) -> tuple[int, str, str]:
    from tpprobe.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def report(path) -> tuple[int, dict]:
    code, out, err = cli("report", str(path), "--json")
    assert err == "", err
    return code, json.loads(out)


def failures(rep):
    return [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] != "info"]


def test_files_are_sglangs(dumps):
    """What we read is what SGLang's dumper wrote: its names, its dict, its parallel info."""
    files = sorted((dumps / "tp2" / "pe_repl").iterdir())
    assert [f.name
            for f in files][0] == "step=0___rank=0___dump_index=1___name=input_ids___recompute_status=disabled.pt"
    d = torch.load(files[-1], weights_only=True)
    assert set(d) == {"value", "meta"}
    assert d["meta"]["sglang_parallel_info"]["tp_size"] == 2 and d["meta"]["dims"] == "t h # tp:replicated"


def test_healthy_run_zero_findings_full_coverage(dumps):
    code, rep = report(dumps / "tp2" / "healthy")
    assert code == 0 and rep["findings"] == []
    cov = rep["coverage"]
    assert cov["files"] == cov["records_read"] == 24 and cov["groups"] == cov["checked"] == 12 and cov["names"] == 6
    reads = {(r["name"], r["step"]): r["read"] for r in rep["records"]}
    assert reads[("embed", 1)] == "replicated" and reads[("o_proj", 0)] == "partial" and reads[("qkv", 1)] == "sharded"
    assert rep["tp_size"] == 2 and rep["tp_source"] == "sglang_parallel_info" and rep["steps"] == [0, 1]
    code, out, _ = cli("report", str(dumps / "tp2" / "healthy"))
    assert code == 0 and "HEALTHY: all 12 records" in out


def test_a_whole_rank_missing_is_named_not_healthy(dumps, tmp_path):
    # rank 0's files alone of a tp-2 dump: every record looks "single", but the records say tp 2
    for f in (dumps / "tp2" / "healthy").iterdir():
        if "___rank=0___" in f.name:
            shutil.copy(f, tmp_path / f.name)
    code, rep = report(tmp_path)
    assert code == 1 and failures(rep) == [("capture-file", "the whole dump", [1])], rep["findings"]
    assert rep["findings"][0]["detail"] == ("the records declare tp 2 but the folder holds files of rank 0 only: "
                                            "rank 1 is missing (not copied, or its dumper never wrote); no record "
                                            "was compared with it")
    code, out, _ = cli("report", str(tmp_path))
    assert code == 1 and "HEALTHY" not in out


def test_a_missing_rank_of_a_second_tp_group_is_named_by_its_tp_rank(dumps, tmp_path):
    # the files of global rank 3 alone, which SGLang's meta says is tp rank 1 of a tp-2 group (ranks 2 and
    # 3): the rank missing is tp rank 0, global rank 2, not ranks 0 and 1
    for f in (dumps / "tp2" / "healthy").iterdir():
        if "___rank=1___" in f.name:
            shutil.copy(f, tmp_path / f.name.replace("___rank=1___", "___rank=3___"))
    code, rep = report(tmp_path)
    assert code == 1 and failures(rep) == [("capture-file", "the whole dump", [2])], rep["findings"]
    assert "files of rank 3 (tp rank 1) only: rank 2 (tp rank 0) is missing" in rep["findings"][0]["detail"]


def test_a_one_rank_folder_is_not_checked_across_ranks_never_healthy(dumps, tmp_path):
    """A tp-1 dump (one rank's files): nothing is compared across ranks, so the verdict says so (exit 0: what
    could be checked passed), never HEALTHY; a NaN on that one rank is still named."""
    base = dumps / "tp1" / "base"
    code, out, err = cli("report", str(base))
    text = " ".join(out.split())
    assert code == 0 and err == "" and "HEALTHY" not in out, out
    assert "5 records over 5 names, 5 checked, none of them across ranks" in text, text
    assert ("NOT CHECKED ACROSS RANKS: the folder holds the files of rank 0 (tp 1) only, so no record was compared "
            "with another rank; its 5 records were read and hold no NaN or Inf "
            f"(`tpprobe diff {base} OTHER` compares them with another run)") in text, text
    code, rep = report(base)
    assert code == 0 and rep["findings"] == [] and (rep["coverage"]["checked"], rep["coverage"]["across_ranks"]) == \
        (5, 0)
    d = tmp_path / "base"
    shutil.copytree(base, d)
    f = next(d.glob("*___name=h___*.pt"))
    rec = torch.load(f, weights_only=True)
    rec["value"][2, 0] = float("nan")
    torch.save(rec, f)
    code, rep = report(d)
    assert code == 1 and failures(rep) == [("non-finite", "h (step 0)", [0])], rep["findings"]
    assert rep["findings"][0]["detail"] == "1 NaN/Inf values on rank 0, the one rank that dumped it"


def test_one_ulp_bf16_is_noise_not_a_failure(dumps):
    code, rep = report(dumps / "tp2" / "noise")
    assert code == 0 and failures(rep) == []
    (f,) = rep["findings"]
    assert f["kind"] == "rounding-noise" and f["severity"] == "info" and f["ranks"] == [1]
    s = rep["records"][0]["per_rank"]["1"]
    assert s["level"] == "noise" and s["ulp_max"] == 1.0 and s["differing"] == (16 * 32 + 6) // 7


@pytest.mark.parametrize("exp", ["pe_repl", "pe_bare"])
def test_partial_embedding_named_without_annotation(dumps, exp):
    """Labelled replicated (as SGLang's comparator is told) or not labelled at all: named partial."""
    code, rep = report(dumps / "tp2" / exp)
    assert code == 1
    assert failures(rep) == [("partial-allreduce", "embed (step 0)", [0, 1])]
    f = rep["findings"][0]
    assert f["evidence"]["rows_nonzero_on_one_rank"] == 1.0 and f["evidence"]["ranks_holding_rows"] == 2
    assert ("declare it replicated" in f["detail"]) == (exp == "pe_repl")


def test_partial_sum_reconstructs_a_replicated_record(dumps):
    code, rep = report(dumps / "tp2" / "row_sum")
    assert code == 1 and failures(rep) == [("partial-allreduce", "o_proj (step 0)", [0, 1])]
    assert rep["findings"][0]["evidence"]["sum_equals"] == "hidden_out"


def test_one_percent_on_one_rank_is_divergence(dumps):
    code, rep = report(dumps / "tp2" / "scale")
    assert code == 1 and failures(rep) == [("rank-divergence", "h (step 0)", [1])]
    assert rep["records"][0]["per_rank"]["1"]["first_token"] == 3
    assert rep["findings"][0]["detail"].startswith("rank 1 differs materially from rank 0 (max abs diff ")
    # the message's rel diff is linear (the relative L2 difference), the squared one is the record's rel_diff
    from tpprobe.core.noise import rel_l2
    sq = rep["records"][0]["per_rank"]["1"]["rel_diff"]
    assert f"rel diff {rel_l2(sq):.3g}," in rep["findings"][0]["detail"] and 1e-3 < rel_l2(sq) < 1e-2, sq
    # a dump holds no parameters: its why never blames a weight shard
    why = rep["findings"][0]["explain"]
    assert "weight shard" not in why and "holds no parameters" in why, why


def test_nan_on_one_rank(dumps):
    code, rep = report(dumps / "tp2" / "nan")
    assert code == 1 and failures(rep) == [("non-finite", "h (step 0)", [1])]
    assert rep["findings"][0]["detail"] == "NaN/Inf values on rank 1 only"


def test_tp_slice_and_false_partial_declaration(dumps):
    code, rep = report(dumps / "tp2" / "sliced")
    assert code == 0 and failures(rep) == [("tp-sliced", "qkv (step 0)", [0, 1])]
    assert rep["findings"][0]["severity"] == "warning" and rep["hidden"] == 32
    code, rep = report(dumps / "tp2" / "twice")
    assert code == 0 and failures(rep) == [("dims-mismatch", "h (step 0)", [0, 1])]


def test_emit_dims_is_sglangs_grammar(dumps):
    from sglang.srt.debug_utils.comparator.dims_spec.dims_parser import parse_dims
    code, out, err = cli("report", str(dumps / "tp2" / "tgt"), "--emit-dims")
    # the dims were asked for and written: exit 0 (`... > dims.yaml` succeeds); the undeclared partial
    # embedding is still a finding, named on stderr
    assert code == 0, err
    assert "the dump also has findings" in err
    dims = {}
    lines = out.splitlines()
    for a, b in zip(lines, lines[1:]):
        if a.strip().startswith("- match:"):
            dims[json.loads(a.split("match:")[1].split("#")[0])] = json.loads(b.split("dims:")[1])
    assert dims == {"^input_ids$": "t # tp:replicated", "^embed$": "t h[tp:partial]", "^o_proj$": "t h[tp:partial]",
                    "^qkv$": "t h[tp]", "^h$": "t h # tp:replicated"}
    for d in dims.values():
        parse_dims(d)          # SGLang's own parser accepts every line
    # and the file itself says which dims describe a fault, beside that record alone
    warned = [ln.strip() for ln in lines if "names a FAILURE here" in ln]
    assert warned == ["# embed: `tpprobe report` names a FAILURE here (partial-allreduce): these dims describe the "
                      "files as they are, not as they should be"], out


def test_diff_tp1_vs_tp2_batched_differently(dumps):
    code, out, err = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "tgt"), "--json")
    assert code == 1, out + err
    rep = json.loads(out)
    rows = {r["name"]: r for r in rep["rows"]}
    assert set(rows) == {"embed", "o_proj", "qkv", "h"} and all(r["step"] == "all" for r in rows.values())
    assert "batch differently" in rep["notes"][0]
    assert rows["embed"]["level"] == "bitwise" and rows["embed"]["target_how"] == "Σ 2 ranks [inferred: ranks differ]"
    assert rows["qkv"]["level"] == "bitwise" and rows["qkv"]["target_how"].startswith("cat dim 1 × 2 ranks [inferred")
    assert rows["o_proj"]["target_how"] == "Σ 2 ranks [dims]" and rows["o_proj"]["level"] in ("bitwise", "noise")
    assert rows["h"]["shape"] == [16, 32]
    # the embedding's ranks hold partial sums with no dims saying so: summed to compare, it matches,
    # but diff names it as `report` does (never a MATCH, exit 0)
    assert [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"]] == \
        [("partial-allreduce", "embed (step all, target)", [0, 1])]


def test_diff_names_the_material_record(dumps):
    code, out, _ = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "tgt_bad"), "--json")
    rep = json.loads(out)
    assert code == 1
    # and the target's embedding, each rank's partial sum with no dims, named as `report` names it
    assert [(f["kind"], f["where"]) for f in rep["findings"] if f["severity"] == "failure"] == \
        [("reference-mismatch", "h (step 0)"), ("partial-allreduce", "embed (step 0, target)")]
    assert {r["name"]: r["first_token"] for r in rep["rows"] if r["level"] == "material"} == {"h": 3}
    from tpprobe.core.noise import rel_l2
    h = next(r for r in rep["rows"] if r["name"] == "h")
    assert f"rel diff {rel_l2(h['rel_diff']):.3g}," in rep["findings"][0]["detail"]
    code, out, _ = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "tgt_bad"))
    assert "rel diff²" in out


def test_diff_names_one_diverged_replica_and_does_not_sum_it(dumps):
    # no dims, rank 1 off by 1 % on one token: a replica that diverged, not a partial sum (summed, every value
    # would read doubled and the 1 % would never be named)
    code, out, _ = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "scale"), "--json")
    rep = json.loads(out)
    assert code == 1
    assert [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"] == \
        [("rank-divergence", "h (step 0, target)", [1])], rep["findings"]
    assert "but rank 1 differs materially from the first" in rep["findings"][0]["detail"], rep["findings"]
    [h] = [r for r in rep["rows"] if r["name"] == "h"]
    assert h["target_how"] == "rank 0 (replicated) [inferred: rank 0 equals the other side]"
    assert h["level"] in ("bitwise", "noise")


def test_unsafe_file_refused_in_one_line(dumps, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(dumps / "tp2" / "pe_bare", d)
    import argparse
    victim = next(d.glob("step=0___rank=1___*.pt"))
    torch.save({"value": torch.zeros(2), "meta": argparse.Namespace(x=1)}, victim)
    code, out, err = cli("report", str(d))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "refused" in err and victim.name in err and "Traceback" not in err
    victim.write_bytes(b"PK\x03\x04 truncated")
    code, _, err = cli("report", str(d))
    assert code == 2 and "not a readable torch.save file" in err and len(err.strip().splitlines()) == 1


def test_the_dumpers_dir_of_several_experiments_asks_for_one(dumps):
    """SGLang's dumper writes one folder per experiment under its `dir`: given that `dir`, report and diff name
    the experiments and ask for one (exit 2, one line), on either side of a diff."""
    tp2 = dumps / "tp2"
    want = (f"tpprobe: error: {tp2} holds 11 SGLang dumper experiments (healthy, nan, noise, pe_bare and 7 more), "
            f"not one dumper folder: pass one of them, e.g. {tp2 / 'healthy'}\n")
    for argv in (["report", str(tp2)], ["report", str(tp2), "--json"], ["diff", str(dumps / "tp1"), str(tp2)],
                 ["diff", str(tp2), str(dumps / "tp1" / "base")]):
        code, out, err = cli(*argv)
        assert (code, out, err) == (2, "", want), argv


def test_a_sink_over_a_dumper_file_is_refused(dumps, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(dumps / "tp2" / "healthy", d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    victim = sorted(d.iterdir())[0]
    for argv in (["report", str(d), "--html", str(victim)], ["diff", str(dumps / "tp1" / "base"), str(d),
                                                              "--markdown", str(victim)]):
        code, out, err = cli(*argv)
        flag, example = argv[-2], "report.html" if argv[-2] == "--html" else "report.md"
        assert (code, out) == (2, ""), err
        assert err == (f"tpprobe: error: {flag} {victim} names a .pt file of the SGLang dumper folder {d}: tpprobe "
                       f"never writes over a capture's own files; give another file name, e.g. {flag} {d / example}\n")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_diff_refuses_a_dumper_folder_against_a_file(dumps, tmp_path):
    f = tmp_path / "x.pt"
    torch.save(torch.zeros(2, 4), f)
    code, _, err = cli("diff", str(dumps / "tp1" / "base"), str(f))
    assert code == 2 and "is an SGLang dumper folder" in err and len(err.strip().splitlines()) == 1


def test_report_names_the_partial_embedding_diff_names(dumps):
    rc, rep = report(dumps / "tp2" / "tgt_bad")
    assert ("partial-allreduce", "embed (step 0)", [0, 1]) in failures(rep)


def test_diff_and_report_agree_on_a_partial_record_without_dims(dumps):
    """A record whose ranks each hold a partial sum, with no dims: `report` names it; `diff` never
    sums it into a MATCH without saying so."""
    rc, rep = report(dumps / "tp2" / "pe_bare")
    assert rc == 1 and failures(rep) == [("partial-allreduce", "embed (step 0)", [0, 1])]
    code, out, _ = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "pe_bare"))
    assert code == 1 and "MATCH" not in out and "partial-allreduce at embed (step 0, target)" in out, out


def test_diff_names_a_partial_declared_replicated(dumps):
    """The comparator's case: an embedding labelled `# tp:replicated` that is each rank's partial."""
    code, out, _ = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "pe_repl"), "--json")
    rep = json.loads(out)
    assert code == 1
    assert [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"] == \
        [("partial-allreduce", "embed (step 0, target)", [0, 1])]


def test_report_streams_two_records_at_a_time(dumps, monkeypatch):
    """No more than two rank records are alive at once, whatever the folder holds."""
    import weakref

    from tpprobe.dumpdir import check as D
    alive, peak, real = set(), [0], D.load

    def counting(f):
        v, meta = real(f)
        key = id(v)
        alive.add(key)
        weakref.finalize(v, alive.discard, key)
        peak[0] = max(peak[0], len(alive))
        return v, meta

    monkeypatch.setattr(D, "load", counting)
    for exp in ("healthy", "tgt", "row_sum"):
        peak[0] = 0
        rep = D.report_data(dumps / "tp2" / exp)
        assert rep["coverage"]["checked"] > 0 and peak[0] <= 2, (exp, peak[0])


def test_load_maps_new_files_and_reads_old_ones_whole(tmp_path):
    """Files are memory-mapped (weights_only still); a file in torch's legacy format, which cannot be
    mapped, is read whole, with the same values."""
    from tpprobe.formats import sglang_dump as D
    v = torch.arange(12.).reshape(3, 4).to(torch.bfloat16)
    new, old = (tmp_path / "step=0___rank=0___dump_index=1___name=h.pt",
                tmp_path / "step=0___rank=1___dump_index=1___name=h.pt")
    torch.save({"value": v, "meta": {"dims": "t h"}}, new)
    torch.save({"value": v, "meta": {"dims": "t h"}}, old, _use_new_zipfile_serialization=False)
    a, meta = D.load(new)
    b, _ = D.load(old)
    assert meta == {"dims": "t h"} and torch.equal(a, v) and torch.equal(b, v)
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else None
    if maps is not None:                        # mapped while its tensor lives (Linux)
        assert str(new) in maps and str(old) not in maps


# ---- one sink: the dumper's report and diff write --html and --markdown like every command
def test_report_and_diff_write_html_and_markdown(dumps, tmp_path):
    from tests.ranks.test_sinks import assert_written
    code, out, err = cli("report", str(dumps / "tp2" / "row_sum"), "--html", str(tmp_path / "rep.html"),
                         "--markdown", str(tmp_path / "rep.md"))
    assert code == 1, out + err
    rep = json.loads(cli("report", str(dumps / "tp2" / "row_sum"), "--json")[1])
    line = next(f["line"] for f in rep["findings"] if f["severity"] == "failure")
    rec = rep["records"][0]
    assert_written(tmp_path, "rep", line, [[rec["name"], str(rec["step"]), rec["read"]]])
    assert f"HTML report: {tmp_path / 'rep.html'}" in out

    code, out, err = cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "tgt_bad"),
                         "--html", str(tmp_path / "diff.html"), "--markdown", str(tmp_path / "diff.md"))
    assert code == 1, out + err
    d = json.loads(cli("diff", str(dumps / "tp1" / "base"), str(dumps / "tp2" / "tgt_bad"), "--json")[1])
    bad = next(r for r in d["rows"] if r["level"] == "material")
    line = next(f["line"] for f in d["findings"] if f["severity"] == "failure")
    assert_written(tmp_path, "diff", line, [[bad["name"], str(bad["step"]), bad["baseline_how"], "material"]])
