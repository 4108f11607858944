"""The tpprobe SGLang plugin, loaded through SGLang's own load_plugins() in real gloo ranks
running the tiny models: writes per-rank capture files + a manifest that `tpprobe report` checks offline (exit 0 on a
healthy step, 1 naming partial-allreduce at the embedding when its reduce was skipped), with
layer.K.out equal to HF's hidden_states[K+1]; does nothing when TPPROBE_CAPTURE_DIR is unset.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when tests/ is a package
from sglang_ranks import run_ranks  # noqa: E402
from tpprobe.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 3, 6, 5
IDS = {"llama": [0, 1], "deepseek_v2": [0, 2]}
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def worker(ctx, arch, broken_step):
    import os

    from tpprobe.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from tpprobe.sglang.tiny import build_target, hf_reference

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


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_plugin_capture_checked_offline_by_tpprobe_report(tmp_path, arch):
    from tpprobe.capture.files import load_run

    broken = arch == "llama"    # one process set per arch: llama also captures a broken step
    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe",
           "TPPROBE_MAX_STEPS": "2" if broken else "1"}
    res = run_ranks("test_sglang_plugin:worker", 2, dict(arch=arch, broken_step=broken), env=env, timeout=150)
    steps = ["step-000", "step-001"] if broken else ["step-000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == steps
    run = load_run(tmp_path / "step-000")
    assert run.problems == [] and sorted(run.records) == [0, 1]
    st = run.manifest["settings"]
    for key in ("world_size", "dtype", "hidden", "num_layers", "layer_ids", "expected_points"):
        assert key in st, key
    assert st["world_size"] == 2 and st["num_layers"] == L and st["dtype"] == "float32"
    hs = res[0]["hf"]
    for rank, rec in run.records.items():
        assert rec.meta["source"] == "sglang-plugin" and rec.meta["forward_mode"] == "extend"
        assert rec.meta["allreduces"] and rec.meta["unreduced_rows"] == []
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4)
        for k in range(L):      # the stream leaving layer k = HF hidden_states[k+1] (pre-norm last)
            assert torch.allclose(rec.tensors[f"layer.{k}.out"], hs[k + 1], atol=1e-4), (rank, k)
        assert rec.tensors["aux.packed"].shape == (TOKENS, 2 * hs[0].shape[-1])
    assert torch.equal(run.records[0].tensors["aux.packed"], run.records[1].tensors["aux.packed"])

    code, failures, rep = _report(tmp_path / "step-000")
    assert (code, failures) == (0, []), rep["findings"]
    assert rep["slots"] and all(s["ok"] for s in rep["slots"]), rep["slots"]
    if broken:
        code, failures, _ = _report(tmp_path / "step-001")
        assert code == 1
        assert [f["kind"] for f in failures] == ["partial-allreduce"], failures
        assert "embedding" in failures[0]["where"]


def test_plugin_inert_without_capture_dir(monkeypatch):
    from tpprobe.sglang import plugin

    monkeypatch.delenv("TPPROBE_CAPTURE_DIR", raising=False)
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = repr(getattr(HookRegistry, "_hooks", None))
    plugin.register()
    assert repr(getattr(HookRegistry, "_hooks", None)) == before
