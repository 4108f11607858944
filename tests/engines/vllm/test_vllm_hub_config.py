"""vLLM's own engine on the hub's Kimi-K2.5 config.json (tests/assets/kimi-k2.5: the wrapper with its DeepSeek-V3
text model under `text_config`), shrunk with the options that keep the TP structure and run at real width 7168
on CPU gloo at tp 2: vLLM resolves the text model's class (DeepseekV3ForCausalLM) and the run is healthy.
Sweep: measured 181 s wall and 5.5 GB per rank on 2 cores (the refusal at tp 8, in seconds, is in the CI tier:
tests/ranks/test_hub_configs.py)."""
import json
from pathlib import Path

import pytest

from tests.helpers.ranks import run_cli

KIMI = Path(__file__).resolve().parents[2] / "assets" / "kimi-k2.5" / "config.json"


@pytest.mark.vllm
@pytest.mark.sweep
def test_kimi_at_real_width_runs_healthy_on_vllms_engine(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "r"
    cp = run_cli(["probe", "--engine", "vllm", "--config", str(KIMI), "--nproc", "2", "--num-layers", "2",
                  "--num-experts", "2", "--vocab-size", "1024", "--dtype", "float32", "--tokens", "8", "--quiet",
                  "--timeout", "300", "--out", str(out)], timeout=900)
    assert cp.returncode == 0, cp.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["findings"] == [] and rep["settings"]["hidden"] == 7168
    assert rep["settings"]["model"].startswith("DeepseekV3ForCausalLM (config ")
    assert rep["slots"] and all(s["ok"] for s in rep["slots"])
