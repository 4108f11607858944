"""The tpprobe SGLang plugin, loaded through SGLang's own load_plugins() in real gloo ranks
running the tiny models: writes per-rank capture files + a manifest per (dp, pp) TP group and
forward (DIR/dp0-pp0/step-NNNNNN-MODE) that `tpprobe report` checks offline (exit 0 on a healthy step,
1 naming partial-allreduce at the embedding when its reduce was skipped; over the whole run it names
the first step where ranks diverge), with layer.K.out equal to HF's hidden_states[K+1] where full
tensors are kept (TPPROBE_KEEP=*); by default only fingerprints, and kept tensors stay under
TPPROBE_MAX_BYTES, checked before each copy; does nothing when TPPROBE_CAPTURE_DIR is unset.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 3, 6, 5
IDS = {"llama": [0, 1], "deepseek_v2": [0, 2]}
# what the drafts were trained on: Llama adds 1 to every id; DeepSeek not when the first id is not 1
TRAINED = {"llama": "ids:1,2", "deepseek_v2": "ids:0,2"}
EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))


def worker(ctx, arch, broken_step, rank1_budget=None):
    import os

    from tpprobe.engines.sglang import cpu_mode

    if rank1_budget is not None and ctx.rank == 1:    # rank-local state that must not decide a collective
        os.environ["TPPROBE_MAX_BYTES"] = str(rank1_budget)

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from tpprobe.engines.sglang.tiny import build_target
    from tpprobe.engines.sglang.tiny_weights import hf_reference

    t = build_target(ctx, arch, L, TOKENS, SEED, torch.float32, IDS[arch])
    t.forward()          # step-000: healthy
    if broken_step:
        sys.path.insert(0, EXAMPLES)
        from sglang_faults import skip_embed_reduce

        skip_embed_reduce(t.model.model.embed_tokens)
        t.forward()      # step-001: the embedding skips its all-reduce
    t.forward()          # beyond TPPROBE_MAX_STEPS: must not be captured
    _, hs, _ = hf_reference(arch, L, TOKENS, SEED, prenorm_last=True)
    return {"hf": hs, "dir": os.environ.get("TPPROBE_CAPTURE_DIR")}


def _report(path):
    """`tpprobe report DIR --json` as a user runs it: (exit code, failure findings)."""
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    rep = json.loads(p.stdout)
    return p.returncode, [f for f in rep["findings"] if f["severity"] == "failure"], rep


HIDDEN = 64
BUDGET = 2 * (2 * HIDDEN * 4) + 100    # two 2-row fp32 tensors of hidden 64 fit, a third does not


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_plugin_capture_checked_offline_by_tpprobe_report(tmp_path, arch):
    from tpprobe.formats.capture_dir import load_run

    broken = arch == "llama"    # one process set per arch: llama also captures a broken step
    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe",
           "TPPROBE_MAX_STEPS": "2" if broken else "1",
           # what the draft was trained on (HF hidden_states indices): the slots are checked against it
           "TPPROBE_DRAFT_TRAINED": TRAINED[arch]}
    if broken:
        env["TPPROBE_KEEP"] = "*"          # full tensors, to compare with HF
    else:                                  # fingerprints, plus a sample of rows under a budget
        env.update(TPPROBE_KEEP="layer.*.out,aux.packed", TPPROBE_KEEP_TOKENS="2", TPPROBE_MAX_BYTES=str(BUDGET))
    # deepseek: rank 1 has no byte budget at all (rank-local state): it must still capture the step
    # and join the manifest's gather, with nothing kept (the old plugin skipped the step there: hang)
    res = run_ranks(f"{__name__}:worker", 2,
                    dict(arch=arch, broken_step=broken, rank1_budget=None if broken else 0), env=env, timeout=240)
    group = tmp_path / "dp0-pp0"
    assert [p.name for p in tmp_path.iterdir()] == ["dp0-pp0"]
    # steps are numbered per forward: the 3rd forward (beyond TPPROBE_MAX_STEPS) is not captured
    steps = ["step-000000-extend", "step-000001-extend"] if broken else ["step-000000-extend"]
    assert sorted(p.name for p in group.iterdir()) == steps
    run = load_run(group / "step-000000-extend")
    for rec in run.records.values():
        assert rec.meta.extra["parallel"]["tp_rank"] == rec.rank and rec.meta.extra["parallel"]["tp_size"] == 2
        assert (rec.meta.extra["parallel"]["dp_rank"], rec.meta.extra["parallel"]["pp_rank"]) == (0, 0)
        assert set(rec.meta.fingerprints) >= {"embed.out", *(f"layer.{k}.out" for k in range(L))}
    if not broken:
        _assert_bounded(run)
        code, failures, rep = _report(group / "step-000000-extend")
        assert (code, failures, rep["findings"]) == (0, [], [])
        assert rep["slots"] and all(s["ok"] for s in rep["slots"]), rep["slots"]
        # every point judged (from fingerprints), plus the packed aux tensor
        assert len(rep["points"]) == len(run.records[0].meta.points) + 1 >= L + 3
        return
    assert run.problems == [] and sorted(run.records) == [0, 1]
    st = run.manifest["settings"]
    for key in ("world_size", "dtype", "hidden", "num_layers", "layer_ids", "expected_points"):
        assert key in st, key
    assert st["world_size"] == 2 and st["num_layers"] == L and st["dtype"] == "float32"
    hs = res[0]["hf"]
    for rank, rec in run.records.items():
        assert rec.meta.extra["source"] == "sglang-plugin" and rec.meta.extra["forward_mode"] == "extend"
        assert rec.meta.collectives and rec.meta.unreduced_rows == []
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4)
        for k in range(L):      # the stream leaving layer k = HF hidden_states[k+1] (pre-norm last)
            assert torch.allclose(rec.tensors[f"layer.{k}.out"], hs[k + 1], atol=1e-4), (rank, k)
        assert rec.tensors["aux.packed"].shape == (TOKENS, 2 * hs[0].shape[-1])
    assert torch.equal(run.records[0].tensors["aux.packed"], run.records[1].tensors["aux.packed"])

    code, failures, rep = _report(group / "step-000000-extend")
    assert (code, failures) == (0, []), rep["findings"]
    assert rep["slots"] and all(s["ok"] for s in rep["slots"]), rep["slots"]
    code, failures, _ = _report(group / "step-000001-extend")
    assert code == 1
    assert [(f["kind"], f["where"], f["ranks"]) for f in failures] == \
        [("partial-allreduce", "embedding (model.embed_tokens)", [0, 1])], failures
    # the whole run: the first step and point where the ranks diverge
    code, failures, rep = _report(tmp_path)
    assert code == 1 and rep["first_divergence"] == {
        "group": "dp0-pp0", "step": 1, "forward_mode": "extend", "kind": "partial-allreduce",
        "where": "embedding (model.embed_tokens)", "ranks": [0, 1]}
    assert [(r["step"], r["failures"]) for r in rep["steps"]] == [(0, 0), (1, 1)]
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and "first divergence: step 1 (extend) in dp0-pp0: partial-allreduce at embedding" \
        in " ".join(p.stdout.split()), p.stdout[-2000:]


def _assert_bounded(run):
    """Kept tensors: only the sampled rows of the patterns, within the byte budget; every point
    still has its fingerprint; what did not fit is named."""
    assert sorted(run.records) == [0, 1]
    assert run.records[1].tensors == {} and run.records[1].meta.kept_bytes == 0
    assert run.records[1].meta.extra["budget_refused"]
    for rec in run.records.values():
        kept = {n: t for n, t in rec.tensors.items()}
        assert rec.meta.hidden == HIDDEN
        assert (rec.rank == 1 or kept) and set(kept) <= {"aux.packed",
                                                         *(f"layer.{k}.out" for k in range(L))}, sorted(kept)
        assert all(t.shape[0] == 2 for t in kept.values())
        assert sum(t.numel() * t.element_size() for t in kept.values()) == rec.meta.kept_bytes <= BUDGET
        assert rec.meta.extra["budget_refused"], "the budget must have refused the third tensor"
        assert not set(rec.meta.extra["budget_refused"]) & set(kept)


def test_plugin_inert_without_capture_dir(monkeypatch):
    from tpprobe.engines.sglang import plugin

    monkeypatch.delenv("TPPROBE_CAPTURE_DIR", raising=False)
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = repr(getattr(HookRegistry, "_hooks", None))
    plugin.register()
    assert repr(getattr(HookRegistry, "_hooks", None)) == before


def error_worker(ctx):
    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from tpprobe.engines.sglang.tiny import build_target

    t = build_target(ctx, "llama", L, TOKENS, SEED, torch.float32, IDS["llama"])
    outs = [t.forward() for _ in range(3)]     # the first fails to be written; the rest are not captured
    return [type(o).__name__ for o in outs]


def test_unwritable_capture_dir_is_logged_once_and_the_forwards_go_on(tmp_path):
    """The shared step writer (vLLM's plugin writes through it too): every rank's mkdir fails (the
    folder is under a regular file), the ranks learn it from the step's all-gather, TP rank 0 logs
    it in ONE line, every rank stops capturing, and every forward still returns."""
    from tests.helpers.sglang_ranks import LAST_LOGS

    (tmp_path / "a-file").write_text("not a folder")
    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path / "a-file" / "cap"), "SGLANG_PLUGINS": "tpprobe",
           "TPPROBE_MAX_STEPS": "3"}
    res = run_ranks(f"{__name__}:error_worker", 2, {}, env=env, timeout=240)
    assert len(res) == 2 and all(len(r) == 3 for r in res), res
    lines = [x for log in LAST_LOGS for x in log.splitlines() if "capture FAILED" in x]
    assert len(lines) == 1, "\n".join(LAST_LOGS)[-4000:]
    assert "at step 0 (extend) on tp rank(s) [0, 1]: NotADirectoryError" in lines[0], lines[0]
    assert "the plugin stops capturing, the engine goes on" in lines[0]
    ours = [x for log in LAST_LOGS for x in log.splitlines() if x.startswith("[tpprobe pid=")]
    assert not [x for x in ours if " wrote " in x or "step 1" in x or "step 2" in x], ours


def test_a_described_build_sets_the_slots_the_plugin_expects(tmp_path):
    """TPPROBE_ID_RULE goes through the plugin's slot expectations (tpprobe.engines.capture_rule): SGLang's
    DeepSeek as shipped captures HF hidden_states[2] for id 2; described as a build where id 2 is layer 2's
    output (hidden_states[3]), the same capture reads one layer early at aux slot 1."""
    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "1",
           "TPPROBE_KEEP": "*", "TPPROBE_ID_RULE": "2=out:2"}
    run_ranks(f"{__name__}:worker", 2, dict(arch="deepseek_v2", broken_step=False), env=env, timeout=240)
    from tpprobe.formats.capture_dir import load_run
    step = tmp_path / "dp0-pp0" / "step-000000-extend"
    code, failures, rep = _report(step)
    assert code == 1 and [(f["kind"], f["where"], f["ranks"]) for f in failures] == \
        [("capture-offset", "aux slot 1", [0, 1])], failures
    # one slot shifted alone is no evidence about the id rule: no "+1 not applied" guess (that is said only
    # when every slot shifted alike)
    assert failures[0]["detail"] == "slot 1 (id 2) equals layer 1's output, expected layer 2's output: one layer early"
    assert load_run(step).manifest["settings"]["id rule"] == \
        "your build (TPPROBE_ID_RULE=2=hs:3): id 2 = residual stream leaving the last layer, before the final norm " \
        "(HF hidden_states[3] is after it)"      # the tiny model has 3 layers: layer 2 is the last


def test_a_setting_the_plugin_cannot_read_is_one_line_and_the_forwards_go_on(tmp_path):
    """TPPROBE_MAX_STEPS=abc on SGLang's own load_plugins() in real gloo ranks: reading the settings used to raise
    in register(), which SGLang logs as a traceback ("Failed to execute general plugin"). Now each rank's process
    says ONE line (the variable, its value, what it takes, that the plugin is off; on a server, its processes
    inherit the first one's word and stay quiet), registers nothing, and every forward returns; no folder."""
    from tests.helpers.sglang_ranks import LAST_LOGS

    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path / "cap"), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "abc"}
    res = run_ranks(f"{__name__}:error_worker", 2, {}, env=env, timeout=240)
    assert len(res) == 2 and all(len(r) == 3 for r in res), res
    line = ("TPPROBE_MAX_STEPS='abc': not a whole number >= 0 (it takes the number of forwards to capture per rank, "
            "e.g. 8); the tpprobe SGLang plugin is OFF for this server (nothing is captured or watched): set it right "
            "and restart the server")
    for log in LAST_LOGS:
        ours = [x[x.index("[tpprobe pid="):] for x in log.splitlines() if "[tpprobe pid=" in x]
        assert [x.split("] ", 1)[1] for x in ours] == [line], "\n".join(LAST_LOGS)[-4000:]
        assert "Failed to execute general plugin" not in log and "Traceback" not in log, log[-4000:]
    assert not (tmp_path / "cap").exists()
