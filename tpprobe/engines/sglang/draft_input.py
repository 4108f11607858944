"""The SGLang plugin's capture of what the EAGLE-3 draft receives, on every TP rank, per request.

Where SGLang 0.5.23 hands it over (read in its code):
- the target's forward packs the captured streams into `LogitsProcessorOutput.hidden_states`
  (layers/logits_processor.py:869, `pack_aux_hidden_states`, layers/aux_hidden_states.py:97-102; the
  target's batch runs with `CaptureHiddenMode.FULL` so every token's row is kept);
- after a prefill, `EagleDraftWorker._draft_extend_for_prefill` (speculative/eagle_worker_v2.py:961) installs
  `EagleDraftExtendInput(hidden_states=target_hidden_states)` (:1009-1014), `target_hidden_states` being
  `batch_output.logits_output.hidden_states` (:1597); after a verify, `_draft_extend_for_decode` (:1110)
  installs `EagleDraftExtendInput(hidden_states=batch_result.logits_output.hidden_states,
  num_accept_tokens=accept_lens, num_tokens_per_req=num_draft_tokens)` (:1149-1157);
- the draft reads it as `forward_batch.spec_info.hidden_states` (models/llama_eagle3.py:237) and projects it
  with `fc` when it is wider than its hidden size (:238-247).

`LlamaForCausalLMEagle3` inherits `LlamaForCausalLM.forward`, which the plugin wraps, so the plugin's wrapper
sees the draft's forwards: `around_draft` takes `forward_batch.spec_info.hidden_states` there, when it is the
target's packed aux (wider than the draft's hidden size; the draft's own multi-step decode feeds it its own
hidden state, which is not captured) and the target forward that produced it was captured (the same row
count). It writes DIR/dp{D}-pp{P}/step-{N:06d}-draft_input/ (N: that target forward's index) with the
tensor as `aux.packed`, matched slot by slot on the rank against the target forward's streams, and the
rows of each request (`requests`: rid, first row, rows, accepted rows after a verify; rejected rows are the
rest). The expected slots come from the draft's own config (its `eagle_aux_hidden_state_layer_ids`, nested
or top level, under SGLang's rule for the target's architecture) and, when the user says it, from what the
draft was trained on (tpprobe/engines/draft_training.py). A SpecForge sample (`specforge:PATH`) is matched,
slot by slot, to the streams of the first captured prefill that served its tokens: until then the plugin
keeps each prefill's streams (SAMPLE_STREAMS, under the byte budget), and the match holds for the worker's
later steps, the target's included.

Under CUDA graphs (a GPU server), the draft-extend after a verify replays a graph
(`cuda_graph_runner_for_draft_extend.execute`, eagle_worker_v2.py:1203-1210) and runs no Python of the
model's: only prefill draft-extends, which run eagerly, are captured (docs/acceptance.md, SGLang).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# process-wide by nature: the last captured target forward of this SGLang worker, awaiting its draft
_LAST: dict = {}
# a SpecForge sample's slots once matched to a captured prefill (TPPROBE_DRAFT_TRAINED=specforge:PATH):
# path -> (HF hidden_states index per slot, how it was matched); the worker's later steps reuse it
_MATCHED: dict = {}
# the target's streams a sample is matched to, kept (under the byte budget) while no sample is matched yet
SAMPLE_STREAMS = ("embed.out", "layer.*.out")
_SAID: dict = {}          # the refusals of a training list this worker said (once each)


@dataclass(frozen=True)
class Host:
    """What the plugin (tpprobe/engines/sglang/plugin.py) lends this module: its TP group, ranks, byte
    budget, step writer, mode names, step state and log line (passed in: the plugin imports this module)."""
    tp: Callable
    parallel_ranks: Callable
    budget: Callable
    write_step: Callable
    mode_name: Callable
    steps: dict
    say: Callable


def is_eagle3_draft(model) -> bool:
    """SGLang's EAGLE-3 draft models: an `fc` projection of the aux hidden states on the inner model."""
    inner = getattr(model, "model", None)
    return "Eagle3" in type(model).__name__ and isinstance(getattr(inner, "fc", None), torch.nn.Linear)


def remember_target(*, tap, step: int, mode: str, input_ids, model, aux: Optional[torch.Tensor]) -> None:
    """Called by the plugin after it captured a target forward whose output packs aux hidden states."""
    _LAST.clear()
    if aux is not None:
        _LAST.update(tap=tap, step=step, mode=mode, input_ids=input_ids, model=model, rows=int(aux.shape[0]))


def draft_ids(config) -> tuple[Optional[list[int]], Optional[str]]:
    """The ids the draft declares and where: the nested `eagle_config` (where SGLang's target side reads them,
    model_executor/model_runner_components/spec_aux_hidden_state.py:185-196) first, then the top level (read by
    the draft alone to size its fc: models/llama_eagle3.py:156-161, speculative/eagle_utils.py:261-276)."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids:
        return [int(i) for i in ids], "eagle_config"
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    return ([int(i) for i in ids], "top level") if ids else (None, None)


def requests(forward_batch, spec_info, rows: int) -> list[dict]:
    """Each request's rows of the draft's input: a prefill's extend lengths, or after a verify
    `num_tokens_per_req` rows each of which the first `num_accept_tokens` were accepted."""
    rids = list(getattr(forward_batch, "rids", None) or [])
    per = getattr(spec_info, "num_tokens_per_req", -1)
    accepted = getattr(spec_info, "num_accept_tokens_cpu", None)
    if accepted is None and isinstance(getattr(spec_info, "num_accept_tokens", None), torch.Tensor):
        accepted = spec_info.num_accept_tokens.tolist()
    if accepted is not None and per and per > 1:
        lens, acc = [per] * len(accepted), [int(a) for a in accepted]
    else:
        lens = list(getattr(forward_batch, "extend_seq_lens_cpu", None) or [rows])
        acc = list(lens)
    out, start = [], 0
    for i, n in enumerate(lens):
        out.append({"rid": str(rids[i]) if i < len(rids) else str(i), "first_row": start, "rows": int(n),
                    "accepted_rows": int(acc[i]) if i < len(acc) else int(n)})
        start += int(n)
    return out


def sample_pending(training: Optional[dict]) -> bool:
    """Whether the user gave a SpecForge sample not matched to a captured prefill yet."""
    return bool(training) and "specforge" in training and training["specforge"] not in _MATCHED


def tap_forwards(tap, input_ids, reqs: list[dict], where: str) -> list:
    """(token ids, {HF index: stream}, where) of each request of a captured target forward whose streams
    the tap kept: what a SpecForge sample's slots are matched to (draft_training.match_sample)."""
    from tpprobe.engines.draft_training import hs_of_point

    streams = {hs_of_point(n): t for n, t in tap.captures.items()
               if hs_of_point(n) is not None and isinstance(t, torch.Tensor) and t.dim() == 2}
    if not streams or input_ids is None:
        return []
    ids = input_ids.reshape(-1)
    kept = min(int(t.shape[0]) for t in streams.values())
    out = []
    for r in reqs:
        lo = int(r["first_row"])
        hi = min(lo + int(r["rows"]), kept, int(ids.shape[0]))
        if hi > lo:
            out.append((ids[lo:hi], {h: t[lo:hi] for h, t in streams.items()},
                        f"{where}, request {r['rid']}'s rows {lo}..{hi - 1}"))
    return out


def sample_slots(training: dict, forwards: Optional[Callable]) -> tuple[Optional[list[int]], str]:
    """The SpecForge sample's HF hidden_states per slot, matched once to a captured prefill and then
    reused; (None, why) while no captured prefill matches it."""
    from tpprobe.engines import draft_training as dt

    path = training["specforge"]
    if path not in _MATCHED:
        got, how = dt.match_sample(path, forwards() if forwards is not None else [])
        if got is None:
            return None, how
        _MATCHED[path] = (got, how)
    return _MATCHED[path]


def expectation(draft_config, target_model, num_layers: int, training: Optional[dict],
                forwards: Optional[Callable] = None) -> tuple[tuple, dict]:
    """((expected points, ids), settings) of the draft's input: its config's ids under SGLang's rule for the
    target's architecture, or what the draft was trained on when the user said it (`forwards()`: the
    captured target forward's requests, a SpecForge sample's slots are matched to)."""
    from tpprobe.engines import capture_rule, draft_training as dt
    from tpprobe.engines.sglang import layer_ids as lid

    arch = str(getattr(getattr(target_model, "config", None), "model_type", "llama"))
    ids, ids_from = draft_ids(draft_config)

    def slots_for(cand):
        try:
            p = lid.plan(arch, cand, num_layers)
        except Exception:  # noqa: BLE001 - an id list the rule rejects fits nothing
            return None
        return None if p.crash else p.slot_hf_indices

    p = lid.plan(arch, ids, num_layers)
    points, exp_ids = lid.expected_slots(p)
    rule_hs = p.slot_hf_indices
    st = {"draft_config_ids": ids, "draft_ids_from": ids_from, "draft_rule_hs": rule_hs, "draft_rule": p.rule,
          "sglang layers_to_capture": str(list(getattr(getattr(target_model, "model", None), "layers_to_capture",
                                                       []) or [])),
          # where the draft and the target were loaded from: `tpprobe report` replays the draft on the target's
          # captured streams (tpprobe/cli/drafter.py)
          **model_paths(draft_config, target_model)}
    trained, said = dt.trained_hidden_states(training, ids), (training or {}).get("from")
    if trained is None and training and "specforge" in training:
        trained, how = sample_slots(training, forwards)
        if trained is None:
            st["draft_training_unmatched"] = f"{said}: {how}"
        said = f"{said}: {how}"
    if trained is not None:     # a list of another length than the draft's slots: refused, never used
        why = dt.slot_count_mismatch((training or {}).get("from", "").partition("=")[2], trained, ids, len(points),
                                     capture_rule.config_field("sglang") if ids_from == "eagle_config" else
                                     "eagle_aux_hidden_state_layer_ids", "the slots SGLang's capture gives it")
        if why:
            trained = None
            st["draft_training_refused"] = why
    if trained is None:
        st["draft_basis"] = "config"
        return (points, exp_ids), st
    st.update(draft_basis="trained", draft_trained_hs=trained, draft_training_from=said)
    if trained != rule_hs:
        fix, why = dt.propose_ids(trained, slots_for, num_layers)
        st["draft_fix"] = (f"fix: set eagle_config.eagle_aux_hidden_state_layer_ids to {fix} ({why})" if fix
                           else f"no id list fits: {why}")
    exp = [dt.hs_point(h) for h in trained]
    return (exp, [ids[i] if ids and i < len(ids) else None for i in range(len(exp))]), st


def model_paths(draft_config, target_model) -> dict:
    """The draft's and the target's folders (their configs' `_name_or_path`, which SGLang's ModelConfig loads
    from the --speculative-draft-model-path / --model-path given; else those server arguments) and the target's
    class."""
    def path(cfg, arg):
        p = getattr(cfg, "_name_or_path", None)
        if not p:
            try:
                from sglang.srt.runtime_context import get_server_args
                p = getattr(get_server_args(), arg, None)
            except Exception:  # noqa: BLE001 - nothing published in this process: unknown
                p = None
        import os
        return os.path.abspath(str(p)) if p and os.path.isdir(str(p)) else (str(p) if p else "")
    return {"draft_path": path(draft_config, "speculative_draft_model_path"),
            "target_path": path(getattr(target_model, "config", None), "model_path"),
            "target_arch": type(target_model).__name__}


def around_draft(original_fn, s: dict, host: Host, model, input_ids, positions, forward_batch, *args, **kwargs):
    """The draft's forward, with its input written first when it is the captured target forward's aux."""
    spec = getattr(forward_batch, "spec_info", None)
    h = getattr(spec, "hidden_states", None)
    hidden = int(getattr(model.config, "hidden_size", 0) or 0)
    last = dict(_LAST)
    if not (isinstance(h, torch.Tensor) and h.dim() == 2 and h.shape[-1] != hidden and last
            and last["rows"] == h.shape[0]):
        return original_fn(model, input_ids, positions, forward_batch, *args, **kwargs)
    _LAST.clear()
    rank, world, tp_group = host.tp()
    budget = host.budget(s)
    t0 = time.time()
    try:
        reqs = requests(forward_batch, spec, int(h.shape[0]))
        from tpprobe.engines.draft_training import from_env
        training = from_env()
        err = None
    except Exception as e:  # noqa: BLE001 - a bad setting is said once, every rank still joins the exchange
        reqs, training, err = [], None, f"{type(e).__name__}: {e}"
    target = last["model"]
    mode = "draft_input"

    def record(s_, step, mode_, rank_, world_, tap, ids_, result, model_, t_forward, budget_):
        from tpprobe.engines.step import step_record, step_settings

        par = host.parallel_ranks()
        rec = step_record(tap, model=target, rank=rank_, world=world_, input_ids=ids_, aux=h, budget=budget_,
                          t_forward=t_forward, extra={
                              "source": "sglang-plugin (draft input)", "step": step, "forward_mode": mode_,
                              "target_forward_mode": last["mode"], "model": type(target).__name__,
                              "draft_model": type(model).__name__,
                              "draft_forward_mode": host.mode_name(forward_batch), "parallel": par,
                              "draft_input": "forward_batch.spec_info.hidden_states (models/llama_eagle3.py:237)",
                              "spec_info": type(spec).__name__, "requests": reqs,
                              "kept_rows": tap.sample_rows, "budget_refused": budget_.refused})
        slots, extra = expectation(model.config, target, rec.layers_hooked, training, lambda: tap_forwards(
            tap, ids_, reqs, f"step {step} ({last['mode']})"))
        refused(extra, rank_, host.say)
        extra["target step"] = f"step-{step:06d}-{last['mode']}"
        return rec, step_settings(rec, target, backend="sglang (live server, plugin: the draft's input)",
                                  tokens=int(h.shape[0]), mode=mode_, step=step, par=par, slots=slots, extra=extra)

    errors = host.write_step(s, last["step"], mode, rank, world, tp_group, last["tap"], last["input_ids"], None,
                               target, time.time() - t0, budget, record=record, error=err,
                               source="sglang-plugin (draft input)")
    if errors:
        host.steps["failed"] = True      # every rank of the TP group saw the same errors: they stop together
    if errors and rank == 0:
        host.say(f"the draft's input at step {last['step']} was not written: {errors[0][1]}")
    return original_fn(model, input_ids, positions, forward_batch, *args, **kwargs)


def refused(settings: dict, rank: int, say: Callable) -> None:
    """TP rank 0 says once per worker that the training given was refused (`draft_training_refused`)."""
    why = settings.get("draft_training_refused")
    if why and rank == 0 and not _SAID.get(why):
        _SAID[why] = True
        say(f"the draft's input: {why}; not used: it is checked against the draft's config only")


def target_expectation(slots: tuple, has_aux: bool) -> tuple[tuple, dict]:
    """The target forward's expected slots: what the draft was trained on when the user gave its
    hidden_states indices (TPPROBE_DRAFT_TRAINED=ids:...), else SGLang's own `layers_to_capture` (`slots`),
    labelled as the engine agreeing with itself (`draft_basis` engine)."""
    if not has_aux:
        return slots, {}
    from tpprobe.engines import draft_training as dt

    training = dt.from_env()
    trained, said = dt.trained_hidden_states(training, None), (training or {}).get("from")
    if trained is None and training and training.get("specforge") in _MATCHED:      # matched at an earlier step
        trained, how = _MATCHED[training["specforge"]]
        said = f"{said}: {how}"
    why = dt.slot_count_mismatch(training["from"].partition("=")[2], trained, None, len(slots[0]), "",
                                 "the slots SGLang's layers_to_capture gives it") if trained is not None else ""
    if trained is None or why:
        return slots, {"draft_basis": "engine", **({"draft_training_refused": why} if why else {})}
    return ([dt.hs_point(h) for h in trained], [h - 1 for h in trained]), {
        "draft_basis": "trained", "draft_trained_hs": trained, "draft_training_from": said}
