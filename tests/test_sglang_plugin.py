"""The tpprobe SGLang plugin, loaded through SGLang's own load_plugins() in real gloo ranks
running the tiny models: writes per-rank capture files + a manifest that tpprobe.capture loads,
with the residual stream equal to HF's hidden states; does nothing when TPPROBE_CAPTURE_DIR is unset.
"""
import pytest
import torch

from sglang_ranks import run_ranks
from tpprobe.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 3, 6, 5


def worker(ctx, arch):
    import os

    from tpprobe.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from tpprobe.sglang.tiny import build_target, hf_reference

    t = build_target(ctx, arch, L, TOKENS, SEED, torch.float32, [0, 1] if arch == "llama" else [0, 2])
    t.forward()
    t.forward()          # beyond TPPROBE_MAX_STEPS=1: must not be captured
    _, hs, _ = hf_reference(arch, L, TOKENS, SEED)
    return {"hf": hs, "dir": os.environ.get("TPPROBE_CAPTURE_DIR")}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_plugin_captures_through_load_plugins(tmp_path, arch, capfd):
    from tpprobe.capture import load_run

    env = {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_MAX_STEPS": "1"}
    res = run_ranks("test_sglang_plugin:worker", 2, dict(arch=arch), env=env, timeout=150)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000"]
    run = load_run(tmp_path / "step-000")
    assert run.problems == [] and sorted(run.records) == [0, 1]
    hs = res[0]["hf"]
    for rank, rec in run.records.items():
        assert rec.meta["source"] == "sglang-plugin" and rec.meta["forward_mode"] == "extend"
        assert rec.meta["allreduces"], "the all-reduce audit is empty"
        assert torch.allclose(rec.tensors["embed.out"], hs[0], atol=1e-4)
        for k in range(L):
            assert torch.allclose(rec.tensors[f"resid.{k}"], hs[k], atol=1e-4), (rank, k)
        assert rec.tensors["aux.packed"].shape == (TOKENS, 2 * hs[0].shape[-1])
    assert torch.equal(run.records[0].tensors["aux.packed"], run.records[1].tensors["aux.packed"])


def test_plugin_inert_without_capture_dir(monkeypatch):
    from tpprobe.sglang import plugin

    monkeypatch.delenv("TPPROBE_CAPTURE_DIR", raising=False)
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = repr(getattr(HookRegistry, "_hooks", None))
    plugin.register()
    assert repr(getattr(HookRegistry, "_hooks", None)) == before
