"""The SGLang plugin reads SGLang's own spec-decode acceptance: SGLang's scheduler code
(`SchedulerBatchResultProcessor._resolve_spec_v2_tokens`, with its real `Req`s and `GenerationBatchResult`s)
counts each verify's accepted drafts per request, the plugin's hook writes them (TP rank 0 only) to
DIR/dp0-pp0/acceptance.json, and `tpprobe report DIR` shows them in JSON, the terminal, HTML and Markdown.
"""
import json
import subprocess
import sys

import pytest

from tests.helpers.sglang_ranks import run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

K = 3                                   # speculative_num_draft_tokens 4: 3 drafts per verify
VERIFIES = [[4, 1], [2, 3], [1, 1]]     # accept_lens (the bonus token included) of two requests, per verify


def worker(ctx):
    import types
    from types import SimpleNamespace

    import torch

    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    publish(ServerArgs(model_path="dummy", tp_size=ctx.world_size, device="cpu", disable_custom_all_reduce=True,
                       speculative_algorithm="EAGLE3", speculative_num_steps=K, speculative_eagle_topk=1,
                       speculative_num_draft_tokens=K + 1, speculative_draft_model_path="dummy-draft"),
            role="scheduler", ranks=SpawnRanks(world_rank=ctx.rank))
    # the scheduler's collaborators of this call, with SGLang's own methods (no server: no fpm, no grammar,
    # the base worker's no-op adaptive hook)
    me = SimpleNamespace(metrics_reporter=SimpleNamespace(scheduler=SimpleNamespace(enable_fpm=False)),
                         model_worker=SimpleNamespace())
    me.metrics_reporter.snapshot_spec_decode_metrics = types.MethodType(
        SchedulerMetricsReporter.snapshot_spec_decode_metrics, me.metrics_reporter)
    me.model_worker.on_verify_complete_cpu = types.MethodType(BaseSpecWorker.on_verify_complete_cpu, me.model_worker)
    me.advance_grammar_fsm = types.MethodType(SchedulerBatchResultProcessor.advance_grammar_fsm, me)
    reqs = [Req(f"req-{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=64)) for i in range(2)]
    batch = SimpleNamespace(reqs=reqs, has_grammar=False, forward_mode=ForwardMode.DECODE)
    for lens in VERIFIES:
        result = GenerationBatchResult(next_token_ids=torch.arange(2 * (K + 1)), accept_lens=torch.tensor(lens),
                                       speculative_num_draft_tokens=K + 1)
        SchedulerBatchResultProcessor._resolve_spec_v2_tokens(me, result, batch)
    return [(r.spec_verify_ct, r.spec_num_correct_drafts, list(r.spec_correct_drafts_histogram)) for r in reqs]


def test_sglang_acceptance_in_the_report(tmp_path):
    res = run_ranks(f"{__name__}:worker", 2, {}, timeout=240,
                    env={"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe"})
    # SGLang's own counters on the requests: 3 verifies each, 3+1+0 and 0+2+0 accepted drafts
    assert res[0] == [(3, 4, [1, 1, 0, 1]), (3, 2, [2, 0, 1])]
    assert [p.name for p in tmp_path.iterdir()] == ["dp0-pp0"]      # TP rank 0 alone writes
    doc = json.loads((tmp_path / "dp0-pp0" / "acceptance.json").read_text())
    assert (doc["source"], doc["engine"], doc["num_spec_tokens"]) == ("sglang-plugin", "sglang 0.5.23", K)
    # the keys the vLLM plugin writes: drafts, draft tokens, accepted, accepted per position, verifies
    assert {k: doc[k] for k in ("drafts", "draft_tokens", "accepted", "accepted_per_pos", "verify_steps")} == \
        {"drafts": 6, "draft_tokens": 18, "accepted": 6, "accepted_per_pos": [3, 2, 1], "verify_steps": 3}
    assert [(s["drafts"], s["accepted_per_pos"]) for s in doc["steps"]] == \
        [(2, [1, 1, 1]), (2, [2, 1, 0]), (2, [0, 0, 0])]
    assert doc["steps"][0]["requests"] == [{"rid": "req-0", "accepted": 3}, {"rid": "req-1", "accepted": 0}]

    # tpprobe report of a capture folder: the acceptance beside the verdict in every sink
    step = tmp_path / "dp0-pp0" / "step-000000-extend"
    _capture_folder(step)
    line = ("sglang 0.5.23: 6 drafts of 3 tokens, 6 accepted: acceptance rate 0.33, mean acceptance length 2.00; "
            "per position [0.50, 0.33, 0.17]")
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(tmp_path), "--json"], capture_output=True,
                       text=True, timeout=120)
    rep = json.loads(p.stdout)
    acc = rep["acceptance"]
    assert (acc["drafts"], acc["accepted"], acc["rate"], acc["mean_acceptance_length"], acc["rate_per_pos"]) == \
        (6, 6, 6 / 18, 2.0, [3 / 6, 2 / 6, 1 / 6])
    assert rep["settings"]["engine acceptance"].startswith(line)
    html, md = tmp_path / "r.html", tmp_path / "r.md"
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(tmp_path), "--html", str(html),
                        "--markdown", str(md)], capture_output=True, text=True, timeout=120)
    assert "engine acceptance: " + line in " ".join(p.stdout.split()), p.stdout[-3000:]
    assert line in html.read_text() and line in md.read_text()


def _capture_folder(step):
    """A one-forward capture folder beside the acceptance (tpprobe probe's built-in model: what the plugin's
    step folders hold is checked elsewhere)."""
    out = subprocess.run([sys.executable, "-m", "tpprobe", "probe", "--nproc", "2", "--out", str(step), "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
