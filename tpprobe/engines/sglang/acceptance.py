"""The SGLang plugin's reading of SGLang's own spec-decode acceptance counts.

SGLang 0.5.23 counts them in the scheduler, per request and verify, in
`SchedulerBatchResultProcessor._resolve_spec_v2_tokens` (managers/scheduler_components/
batch_result_processor.py:770-852): `accept_lens` (EagleVerifyOutput's, the bonus token included) become
`num_correct_drafts = accept_len - num_non_draft_tokens_per_req` (:785-787), and per request it does
`req.spec_verify_ct += 1`, `req.spec_num_correct_drafts += ...` and
`req.update_spec_correct_drafts_histogram(num_correct_drafts)` (:832-836). The server's log line
("accept len", "accept rate") and the `sglang:spec_accept_length` gauge are made from the same counts
(metrics_reporter.py:968-1005, with drafts per verify = `speculative_num_draft_tokens - 1`, else
`speculative_num_steps`, :975-978).

The plugin hooks `Req.update_spec_correct_drafts_histogram` (AFTER: the request and its accepted drafts of
that verify, exactly what the scheduler adds) on TP rank 0 of each (dp, pp) group and writes
DIR/dp{D}-pp{P}/acceptance.json (tpprobe/formats/acceptance.py): at every count for the first 256 drafts,
then at most once a second (a long run's file lags it by at most one second of verifies).
With topk 1 the drafts form a chain, so `n` accepted drafts accept positions 0..n-1.
"""
from __future__ import annotations

import time
from pathlib import Path

from tpprobe.engines.sglang import SGLANG_VERSION

TARGET = "sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram"
COUNTED_AT = ("sglang/srt/managers/scheduler_components/batch_result_processor.py:836 "
              "(_resolve_spec_v2_tokens: req.update_spec_correct_drafts_histogram)")
FLUSH_S = 1.0
EXACT_DRAFTS = 256      # until this many drafts are counted, the file is rewritten at every count

# process-wide by nature: one scheduler (one TP rank) per process counts one run
_STATE: dict = {}


def register(s: dict, say, parallel_ranks, forward_index) -> None:
    """Hook SGLang's count; `parallel_ranks()` and `forward_index()` are the plugin's (passed in: the plugin
    imports this module)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _after_count, HookType.AFTER)
    _STATE.update(dir=s["dir"], say=say, parallel_ranks=parallel_ranks, forward_index=forward_index)


def drafts_per_verify():
    """SGLang's drafts per verify, as its metrics reporter computes it (None when not published)."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        n = getattr(spec, "speculative_num_draft_tokens", None)
        if n:
            return int(n) - 1
        steps = getattr(spec, "speculative_num_steps", None)
        return int(steps) if steps else None
    except Exception:  # noqa: BLE001 - not published in this process: unknown, said as such
        return None


def _after_count(result, req, num_correct_drafts, *args, **kwargs):
    try:
        _count(req, int(num_correct_drafts))
    except Exception as e:  # noqa: BLE001 - the engine goes on; said once
        if not _STATE.get("failed"):
            _STATE["failed"] = True
            say = _STATE.get("say") or print
            say(f"acceptance NOT recorded (logged once): {type(e).__name__}: {e}")
    return result


def _count(req, accepted: int) -> None:
    from tpprobe.formats import acceptance as fmt

    par = _STATE["parallel_ranks"]()
    if par["tp_rank"] != 0:
        return
    acc = _STATE.get("acc")
    if acc is None:
        acc = _STATE["acc"] = fmt.Acceptance(f"sglang {SGLANG_VERSION}", COUNTED_AT, drafts_per_verify(),
                                             "sglang-plugin")
        _STATE["folder"] = Path(_STATE["dir"]) / f"dp{par['dp_rank']}-pp{par['pp_rank']}"
        _STATE["flushed"] = 0.0
    forward = max(_STATE["forward_index"]() - 1, 0)
    pending = _STATE.setdefault("pending", {"forward": forward, "rows": []})
    rid = str(req.rid)
    # a new verify (the previous one is complete): another forward, or a request counted again
    if pending["forward"] != forward or any(r == rid for r, _ in pending["rows"]):
        acc.add(pending["forward"], pending["rows"])
        pending = _STATE["pending"] = {"forward": forward, "rows": []}
    pending["rows"].append((rid, accepted))
    now = time.time()
    if now - _STATE["flushed"] >= FLUSH_S or acc.drafts < EXACT_DRAFTS:
        flush()
        _STATE["flushed"] = now


def flush() -> None:
    """Write the counts so far (the verify in progress included)."""
    from tpprobe.formats import acceptance as fmt

    acc = _STATE.get("acc")
    if acc is None:
        return
    pending = _STATE.get("pending") or {"forward": 0, "rows": []}
    doc = acc.to_json()
    if pending["rows"]:
        tmp = fmt.Acceptance(acc.engine, acc.counted_at, acc.k, acc.source)
        tmp.drafts, tmp.accepted, tmp.verifies = acc.drafts, acc.accepted, acc.verifies
        tmp.per_pos, tmp.steps = list(acc.per_pos), list(acc.steps)
        tmp.add(pending["forward"], pending["rows"])
        doc = tmp.to_json()
    fmt.write(_STATE["folder"], doc)
