"""SGLang as it serves, through the real CLI on real gloo ranks (SGLang's own classes on CPU):

* the default command is healthy per architecture (the documented `--arch deepseek_v2` included):
  the default ids are valid under each architecture's rule, zero failures, every slot as expected;
* the all-reduce audit at GroupCoordinator level counts each of SGLang's 2L+1 reduces once, with
  its group (a coordinator reduce ending in torch.distributed.all_reduce is not counted twice);
* F16 `--inject fused-allreduce-capture` is named partial-capture at the aux slot, with the
  all-reduce, module and layer whose owed sum the capture read too early;
* F18 `--inject capture-no-residual` is named capture-no-residual at the aux slot, in both exchange modes;
* DP attention (tp 4, attention-DP 2): healthy runs clean, each reduce checked against its own
  group; F17 `--inject dp-attention-gather` is named dp-gather-group with the groups involved; the
  reduce faults F2, F22-F25 break the reduce of SGLang's gathered buffer and are named at their layer.

Healthy runs of the other architectures are `sweep` (the captures themselves are proven equal to
HF for qwen3 and qwen3_moe by tests/engines/sglang/test_sglang_archs.py in the default run).
"""

import os
import subprocess
import sys

import pytest

from tests.engines.sglang.test_sglang_probe import ROOT, failures, probe
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L = 4   # test_sglang_probe.probe's --num-layers


def _healthy(rep, arch):
    assert failures(rep) == [], rep["findings"]
    assert rep["slots"] and all(s["ok"] for s in rep["slots"]), rep["slots"]
    ar = rep["allreduce"]
    reduces = [a for a in ar["records"] if a.get("kind") == "all_reduce"]
    # embedding + 2 per layer, each once, at GroupCoordinator level (ending in c10d's allreduce)
    assert ar["incomplete"] == 0 and len(reduces) == 2 * L + 1, ar
    assert all(a["path"] == "sglang.GroupCoordinator.all_reduce+c10d.allreduce_" for a in reduces), reduces
    assert rep["settings"]["arch"] == arch


def _audit_groups(out):
    from tpprobe.formats.capture_dir import load_run

    run = load_run(out)
    return [(a.where, a.group, a.group_size) for a in run.records[0].meta.collectives if a.kind == "all_reduce"]


def test_readme_deepseek_v2_default_command_is_healthy(tmp_path):
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", "deepseek_v2")
    assert code == 0, p.stderr[-3000:]
    _healthy(rep, "deepseek_v2")
    assert rep["settings"]["layer_ids"] == [0, 2]            # ids as given: HF hidden_states[0], [2]
    assert [s["expected"] for s in rep["slots"]] == ["embed.out", "layer.1.out"]
    groups = _audit_groups(tmp_path)
    assert {g for _, g, _ in groups} == {"tp:0"} and all(n == 2 for _, _, n in groups)


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2"])
def test_default_command_is_healthy(tmp_path, arch):
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", arch)
    assert code == 0, p.stderr[-3000:]
    _healthy(rep, arch)
    assert rep["settings"]["layer_ids"] == [-1, 1]           # +1: HF hidden_states[0], [2]


def test_fused_allreduce_capture_is_a_partial_capture_at_its_slot(tmp_path):
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", "qwen3_moe",
                         "--inject", "fused-allreduce-capture")
    assert code == 1, p.stderr[-3000:]
    f = failures(rep)
    assert [(x["kind"], x["where"]) for x in f] == [("partial-capture", "aux slot 1")], rep["findings"]
    assert f[0]["ranks"] == [0, 1] and f[0]["evidence"]["all_ranks"]
    # the owed sum is the MoE block's (layer 1's) reduce, issued at layer 2's boundary, over tp:0
    assert "model.layers.1.mlp, layer 1, group tp:0, 2 ranks" in f[0]["detail"]
    assert "partial sum" in f[0]["detail"] and "layer 1's output" in f[0]["detail"]
    # the residual stream tpprobe observes is unchanged: no other failure, every reduce complete
    assert rep["allreduce"]["incomplete"] == 0
    # the slot table compares each slot's own values across ranks: the partial slots equal no stream and
    # differ on rank 1, though the streams they were meant to hold agree
    assert [(s["slot"], s["matched"], s["differ"]) for s in rep["slots"]] == \
        [(0, "embed.out", []), (1, None, [1])], rep["slots"]
    from tests.helpers.ranks import run_cli
    text = " ".join(run_cli(["report", str(tmp_path)], timeout=120).stdout.split())
    assert "│ 1 │ 1 │ layer.1.out │ no stream │ differ on ranks [1] │" in text and "None" not in text


def test_fused_allreduce_capture_slot_rows_from_fingerprints_alone(tmp_path):
    # the fingerprint exchange holds no other rank's tensors: each rank's fingerprint of the slot that equals
    # no stream says it differs, live as offline
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", "qwen3_moe", "--inject", "fused-allreduce-capture",
                         "--exchange", "fingerprint")
    assert code == 1, p.stderr[-3000:]
    assert [(x["kind"], x["where"]) for x in failures(rep)] == [("partial-capture", "aux slot 1")], rep["findings"]
    assert [(s["slot"], s["matched"], s["differ"]) for s in rep["slots"]] == \
        [(0, "embed.out", None), (1, None, [1])], rep["slots"]


# CI runs the fingerprint exchange (the cause named from sketches alone); the full gather is the sweep's
@pytest.mark.parametrize("exchange", [pytest.param("full", marks=pytest.mark.sweep), "fingerprint"])
def test_capture_without_residual_is_named(tmp_path, exchange):
    # with fingerprints only too: the rank fingerprints the slot that equals no point, compared with each reduce's
    # output sketch (tpprobe/checks/causes.py)
    code, rep, p = probe(tmp_path, "--engine", "sglang", "--arch", "qwen3", "--inject", "capture-no-residual",
                         "--exchange", exchange)
    assert code == 1, p.stderr[-3000:]
    f = failures(rep)
    assert [(x["kind"], x["where"], x["ranks"]) for x in f] == [("capture-no-residual", "aux slot 1", [0, 1])], \
        rep["findings"]
    assert "model.layers.1.mlp.down_proj, layer 1" in f[0]["detail"] and "without the residual" in f[0]["detail"]


def _dp_probe(out, *extra):
    return probe(out, "--engine", "sglang", "--arch", "qwen3", "--dp-attention", "2", "--tokens", "6",
                 *extra, nproc=4, timeout=420)


def _dp_clean_except_aux(out, rep):
    # the stream and every reduce are right under DP attention: the embedding reduces over each
    # attention-TP group, the FFN gathers over tp:0; a sub-group reduce is checked against its group
    ar = rep["allreduce"]
    reduces = [a for a in ar["records"] if a.get("kind") == "all_reduce"]
    assert ar["incomplete"] == 0 and len(reduces) == 2 * L + 2, ar     # + the logits' DP gather
    assert rep["settings"]["attn_dp"] == 2 and rep["settings"]["attn_tp"] == 2
    assert all(p["level"] in ("reference", "bitwise", "noise", "share") for p in rep["points"]
               if p["name"] != "aux.packed"), rep["points"]
    from tpprobe.formats.capture_dir import load_run

    run = load_run(out)
    for r, rec in run.records.items():
        reduces = [a for a in rec.meta.collectives if a.kind == "all_reduce"]
        embed = reduces[0]
        assert (embed.where, embed.group, embed.group_ranks) == ("embed", "attention_tp:0", [0, 1] if r < 2 else [2, 3])
        assert {a.group for a in reduces[1:]} == {"tp:0"}


@pytest.mark.sweep      # the default run's F17 test asserts the same DP path clean beside the aux
def test_dp_attention_tp4_healthy(tmp_path):
    code, rep, p = _dp_probe(tmp_path)
    assert code == 0, p.stderr[-3000:]
    assert failures(rep) == [] and rep["slots"] and all(s["ok"] for s in rep["slots"]), rep
    _dp_clean_except_aux(tmp_path, rep)


def test_dp_attention_gather_over_the_tp_group_is_named_with_its_groups(tmp_path):
    code, rep, p = _dp_probe(tmp_path, "--inject", "dp-attention-gather")
    assert code == 1, p.stderr[-3000:]
    f = failures(rep)
    assert [(x["kind"], x["where"]) for x in f] == [("dp-gather-group", "aux.packed")], rep["findings"]
    assert f[0]["ranks"] == [0, 1, 2, 3]
    assert "gathered over tp:0 (4 ranks) where the attention-TP group (2 ranks: [0, 1] and [2, 3])" in f[0]["detail"]
    _dp_clean_except_aux(tmp_path, rep)
    # the serving causes read on this capture: its slots hold 2 × 6 rows, its streams 6, and the FFN's reduces
    # 2 × 6 rows as the slots do; sizes that differ are evidence (neither F16 nor F18 holds), never an exception
    import torch

    from tpprobe.capture.points import allreduce_out
    from tpprobe.checks.causes import _tensor_causes, explain
    from tpprobe.formats.capture_dir import load_run
    run = load_run(tmp_path)
    rec = run.records[0]
    assert rec.tensors["aux.packed"].shape[0] == 2 * rec.tensors["embed.out"].shape[0] == 12
    assert any(rec.tensors[allreduce_out(a.seq)].shape[0] == 12 for a in rec.meta.reduces
               if allreduce_out(a.seq) in rec.tensors)
    for slot, expected in enumerate(["embed.out", "layer.1.out"]):
        assert _tensor_causes(rec, 64, slot, expected, torch.float32) == \
            {"partial-capture": set(), "capture-no-residual": set()}
        assert explain(None, run.records, sorted(run.records), 64, slot, expected, None, torch.float32) is None


# ---- DP attention only where SGLang's model has it ---------------------------------------------------------------
@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
@pytest.mark.parametrize("inject", [[], ["--inject", "dp-attention-gather"]])
def test_dp_attention_on_an_architecture_without_it_is_one_line_exit_2(tmp_path, arch, cls, inject):
    # SGLang's Llama and Qwen2 split their heads over the whole TP group: under DP attention their ranks
    # computed two different models, and the probe read that as a finding (or crashed on the F17 rows)
    from tests.helpers.ranks import run_cli
    p = run_cli(["probe", "--engine", "sglang", "--arch", arch, "--nproc", "4", "--dp-attention", "2", *inject,
                 "--out", str(tmp_path / "r")], timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip() == (
        f"tpprobe: error: --arch {arch} with --dp-attention 2: SGLang's {cls} (sglang/srt/models/{arch}.py) has no "
        f"DP attention (its attention splits heads over the whole TP group, never over an attention-TP group); DP "
        f"attention runs on --arch qwen3, qwen3_moe or deepseek_v2 (deepseek_v3, kimi_k2): use one of them or drop "
        f"--dp-attention"), p.stderr
    assert not (tmp_path / "r").exists()


def test_the_dp_attention_architectures_are_those_whose_sglang_attention_splits_over_attention_tp():
    # the table tpprobe refuses by is SGLang's own code: an attention whose heads split over attn_tp_size
    import importlib
    import inspect

    from tpprobe.engines.sglang.tiny_archs import DP_ATTENTION_ARCHES, SGLANG_CLASSES
    source = {arch: inspect.getsource(importlib.import_module(f"sglang.srt.models.{m}"))
              for arch, (m, _) in SGLANG_CLASSES.items()}
    splits = {arch: "get_parallel().attn_tp_size" in text for arch, text in source.items()}
    assert sorted(a for a, yes in splits.items() if yes) == sorted(DP_ATTENTION_ARCHES), splits


def test_a_row_output_reduced_as_a_copy_is_not_named_never_reduced(tmp_path):
    # SGLang's Llama under DP attention (refused by the probe, run here with the refusal lifted in the launcher,
    # whose forked ranks inherit it): its boundary copies o_proj's rows into the DP buffer and reduces that, so
    # the tap sees o_proj's own output go unreduced while the audit counts every reduce, complete. The verdict
    # must not say "never all-reduced" beside those numbers: the ranks diverge with every reduce complete.
    import json
    import subprocess
    import sys

    from tests.engines.sglang.test_sglang_probe import ROOT
    code = ("import sys; import tpprobe.engines.sglang.tiny_archs as t; t.DP_ATTENTION_ARCHES += ('llama',); "
            "from tpprobe.cli import main; main(sys.argv[1:])")
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", TPPROBE_RANK_START="fork")
    p = subprocess.run([sys.executable, "-c", code, "probe", "--engine", "sglang", "--arch", "llama", "--nproc", "4",
                        "--dp-attention", "2", "--num-layers", "4", "--tokens", "6", "--out", str(tmp_path), "--json",
                        "--timeout", "120"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=420)
    assert p.returncode == 1, p.stderr[-3000:]
    rep = json.loads(p.stdout[p.stdout.index("{"):])
    assert rep["allreduce"]["incomplete"] == 0, rep["allreduce"]
    assert [(x["kind"], x["where"], x["ranks"]) for x in failures(rep)] == \
        [("rank-divergence", "layer.0.out", [2, 3])], rep["findings"]
    assert "every audited reduce returned the sum of its inputs" in failures(rep)[0]["evidence"]["explain"]


# the reduce faults under DP attention: SGLang copies layer K's o_proj rows (plus the residual, on one rank of each
# attention-TP group) into its gathered buffer and the TP group reduces that buffer, so each fault breaks that reduce
DP_REDUCE_CASES = [
    ("allreduce-scaled@1", "allreduce-incomplete", "layer 1 (model.layers.1)", [0, 1, 2, 3],
     "group tp:0, 4 ranks, shape [12, 64]) ran, but its output is not the sum of its inputs: on ranks [0, 1, 2, 3] "
     "it returned the sum scaled by 2"),
    ("allreduce-one-buffer@1", "allreduce-incomplete", "layer 1 (model.layers.1)", [0, 1, 2, 3],
     "it returned rank 0's input alone (the sum never happened)"),
    ("allreduce-stale@1", "allreduce-incomplete", "layer 1 (model.layers.1)", [0, 1, 2, 3],
     "it returned the previous all-reduce's output (a stale buffer)"),
    ("allreduce-rank@1", "allreduce-incomplete", f"layer {L // 2} (model.layers.{L // 2})", [1],
     "on rank 1 it returned rank 1's input alone"),
    # layer 1 alone: the other layers reduced their copy, so the line names no other layer as unreduced
    ("skip-allreduce@1", "partial-allreduce", "layer 1 (model.layers.1.self_attn.o_proj)", [0, 1, 2, 3],
     "model.layers.1.self_attn.o_proj output was never all-reduced: 1 all-reduce(s) ran in layer 1 (other layers: "
     "2); from here on the stream holds each rank's partial sum"),
    ("skip-allreduce-all", "partial-allreduce", "layer 0 (model.layers.0.self_attn.o_proj)", [0, 1, 2, 3],
     f"the same module's output is unreduced in every layer ({L} of {L})"),
    ("skip-unreadable-allreduce@1", "partial-allreduce", "layer 1 (model.layers.1.self_attn.o_proj)", [0, 1, 2, 3],
     "(other layers: 2); from here on"),
]


# CI runs the fault whose broken reduce leaves one attention-DP group's stream stuck (its later layers add nothing,
# so its later slots equal layer 1's output as the points do: never an aliased capture); the others, and the same
# from fingerprints alone, in the sweep
DP_REDUCE_PARAMS = [pytest.param(*c, "full", id=c[0],
                                 marks=() if c[0] == "allreduce-one-buffer@1" else pytest.mark.sweep)
                    for c in DP_REDUCE_CASES]
DP_REDUCE_PARAMS.append(pytest.param(*DP_REDUCE_CASES[1], "fingerprint", id="allreduce-one-buffer@1-fingerprint",
                                     marks=pytest.mark.sweep))


@pytest.mark.parametrize("inject,kind,where,ranks,says,exchange", DP_REDUCE_PARAMS)
def test_dp_attention_reduce_faults_break_the_reduce_of_the_gathered_buffer(tmp_path, inject, kind, where, ranks,
                                                                            says, exchange):
    code, rep, p = _dp_probe(tmp_path, "--inject", inject, "--exchange", exchange)
    assert code == 1, p.stderr[-3000:]
    f = failures(rep)
    assert [(x["kind"], x["where"], x["ranks"]) for x in f] == [(kind, where, ranks)], rep["findings"]
    assert says in f[0]["detail"], f[0]["detail"]
    if kind == "allreduce-incomplete":
        assert rep["allreduce"]["incomplete"] == 1
        # wrong alike on every rank is said of the reduce's outputs, never of the streams after it (here ranks
        # [2, 3] differ from layer 1 on: each attention-DP group reads its own rows of the buffer)
        assert ("wrong alike on every rank" in f[0]["detail"]) == (len(ranks) == 4), f[0]["detail"]
        assert "The ranks agree" not in f[0]["detail"]
    else:
        assert "unreduced in every layer" not in f[0]["detail"] or inject == "skip-allreduce-all", f[0]["detail"]
    # the noise line's numbers are the noise's own, never a material rank's
    noise = [x for x in rep["findings"] if x["kind"] == "rounding-noise"]
    assert all(float(x["detail"].split("worst element ")[1].split(" ULP")[0]) < 1e3 for x in noise), noise
    if inject == "allreduce-one-buffer@1" and exchange == "full":   # the case: on ranks 2, 3 layers 2, 3 added nothing
        import torch

        from tpprobe.formats.capture_dir import load_run
        run = load_run(tmp_path)
        for r in (2, 3):
            t = run.records[r].tensors
            assert torch.equal(t["layer.1.out"], t["layer.3.out"]), r
        assert not torch.equal(run.records[0].tensors["layer.1.out"], run.records[0].tensors["layer.3.out"])


def test_fused_allreduce_capture_under_dp_attention_is_one_line_exit_2(tmp_path):
    from tests.helpers.ranks import run_cli
    p = run_cli(["probe", "--engine", "sglang", "--arch", "qwen3", "--nproc", "4", "--dp-attention", "2", "--inject",
                 "fused-allreduce-capture", "--out", str(tmp_path / "r")], timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip() == (
        "tpprobe: error: --inject fused-allreduce-capture does not run under --dp-attention: there SGLang holds a "
        "layer's owed partial sum in its gathered buffer (the rows of every attention-DP group), not in the stream "
        "the capture reads; drop --dp-attention to see it"), p.stderr
    assert not (tmp_path / "r").exists()


def test_a_reduce_fault_that_never_fires_gives_no_verdict(tmp_path):
    # at tp 1 SGLang's coordinator reduces nothing, so allreduce-stale never acts: the run says so in one line and
    # exits 2, never HEALTHY, and so does `tpprobe report` on the folder it wrote
    from tests.helpers.ranks import run_cli

    said = ("--inject allreduce-stale@1 did not fire on its one rank: it looks for layer 1's self_attn.o_proj "
            "output in the TP group's all-reduce (GroupCoordinator.all_reduce) or in a buffer it was copied into, and "
            "none came: the model ran unbroken, so this run gives no verdict")
    p = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "1", "--out", str(tmp_path),
                        "--num-layers", str(L), "--tokens", "6", "--seed", "0", "--timeout", "120",
                        "--engine", "sglang", "--arch", "qwen3", "--layers", "-1,1",
                        "--inject", "allreduce-stale@1"], capture_output=True, text=True, cwd=ROOT, timeout=420,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2, p.stderr[-3000:]
    assert [x for x in p.stderr.splitlines() if x.startswith("tpprobe:")] == [f"tpprobe: error: {said}"], p.stderr
    assert "HEALTHY" not in p.stdout and "verdict" not in p.stdout, p.stdout
    r = run_cli(["report", str(tmp_path)], timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"tpprobe: error: {tmp_path}: {said}", r.stderr
    assert r.stdout == ""
