"""`tpprobe report DIR` of a live capture with an EAGLE-3 drafter: its input judged against the draft, vLLM's
acceptance beside it, and (when acceptance is low, or TPPROBE_FIX_REPLAY=1) the draft replayed on the
captured streams for candidate id lists (tpprobe.eagle3.fix, when this build has it)."""
from __future__ import annotations

from ..config.knobs import knob

import tempfile
from pathlib import Path

from ..checks.findings import exit_code


def add_drafter(root: Path, rep: dict) -> None:
    """Add `drafter` (analysis, acceptance, fix proposal) and its findings to a run's report, in place."""
    from ..engines.vllm.acceptance import analyse
    a = analyse(Path(root), skip=frozenset(x["folder"] for x in rep.get("stale_steps") or []))
    if a is None:
        return
    if a["low"] or knob("TPPROBE_FIX_REPLAY") == "1":
        from ..engines.vllm.acceptance import replayed_fix
        a["replay"] = replay_fix(a)
        replayed_fix(a)         # the finding made from the training says what the replay found
    rp = a.get("replay") or {}
    target_fails = [f for f in rep.get("findings") or [] if f["severity"] == "failure"]
    if a["low"] and target_fails and not any(f["severity"] == "failure" for f in a["findings"]):
        explain_by_target(a, rep, target_fails[0])
    elif rp.get("available") and rp.get("explained") and not any(f["severity"] == "failure" for f in a["findings"]):
        # nothing else explains the low acceptance, and the draft itself says another capture serves it better
        from ..checks.findings import Finding
        first = a["steps"][0]
        run = a.get("run") or {}
        a["findings"].insert(0, Finding(
            "id-contract", f"drafter slots, step {first['step']} ({first['forward_mode']})", first["ranks"],
            detail=f"vLLM's acceptance is {run.get('rate', 0):.2f} and the draft, replayed on {rp.get('on')}, "
                   f"reads other streams than its config gives it: {rp.get('line')}",
            evidence={"all_ranks": True, "explain": "the engine captures what the draft's config says, but the "
                                                    "draft was trained on other streams (catalogue F32): only the "
                                                    "draft can tell, replayed on candidate captures"}).to_json())
        a["explained"] = True
        if rp.get("fix_ids") is not None:       # the ids the replay's line says to write
            a["fix_ids"], a["fix_ids_from"] = list(rp["fix_ids"]), "replay"
    rep["drafter"] = a
    rep["findings"] = list(rep.get("findings") or []) + a["findings"]
    rep["exit_code"] = exit_code(rep["findings"])


def explain_by_target(a: dict, rep: dict, f0: dict) -> None:
    """Low acceptance, the draft's input as the draft expects it, and the target's own forward failing (a wrong
    all-reduce, a skipped one, ...): that failure is the cause. The draft predicts from the streams it receives; vLLM
    verifies its drafts against the tokens the broken forward samples, so they stop agreeing. The first
    failure of the run's first failing step says it explains the acceptance; the warning that the input passes
    every check (and the replay advice in it) gives way to it."""
    run = a.get("run") or {}
    d = rep.get("first_divergence") or {}
    step = f"step {d['step']} ({d['forward_mode']})" if d.get("step") is not None else "the first captured step"
    old = f0.get("detail") or ""
    f0["detail"] = old.rstrip(".") + (
        f"; it explains vLLM's acceptance {run.get('rate') or 0:.2f} (mean acceptance length "
        f"{run.get('mean_acceptance_length') or 0:.2f}): the target's own forward is wrong at {f0['where']} from "
        f"{step} on, and vLLM verifies the drafts against the tokens that forward samples; what the draft receives "
        f"passes every drafter check")
    if old and old in (f0.get("line") or ""):
        f0["line"] = f0["line"].replace(old, f0["detail"])     # the sinks print the line
    a["findings"] = [f for f in a["findings"] if f.get("kind") != "acceptance-low"]
    a["explained"] = True
    a["explained_by"] = {"kind": f0["kind"], "where": f0["where"], "ranks": f0["ranks"], "step": d.get("step"),
                         "forward_mode": d.get("forward_mode")}


def replay_fix(a: dict) -> dict:
    """The draft (its folder as the engine loaded it) replayed, teacher-forced, on the captured streams of the
    longest captured prompt, for candidate id lists; {"available": False, "why": ...} when it cannot run."""
    import importlib
    try:
        fixlib = importlib.import_module("tpprobe.eagle3.fix")    # the replay library: absent from older builds
    except ImportError:
        return {"available": False, "why": "the draft replay (tpprobe.eagle3.fix) is not in this build"}
    from ..engines.vllm.draft_streams import replay_streams
    try:
        got = replay_streams(a)
        if not got:
            return {"available": False, "why": "no captured prompt of 3+ tokens with every layer's stream kept "
                                                "(raise TPPROBE_MAX_BYTES, or capture a prefill)"}
        from ..eagle3.accept.draft import load_draft
        from ..eagle3.target_head import score_on_target
        with tempfile.TemporaryDirectory() as tmp:
            draft = load_draft(a["draft_model"], target_embedding(a.get("target_model"), Path(tmp)))
        # the prompt with the most positions where it goes on as the target would (the longest, when the target's
        # own tokens cannot be read)
        best = None
        for input_ids, by_hf, where in got:
            streams = fixlib.streams_from_tensors(input_ids, by_hf, a["num_layers"], source=where)
            scored, why = score_on_target(streams, a.get("target_model"))
            if best is None or (not why and (best[2] or streams.decode_like > best[0].decode_like)):
                best = (streams, scored, why, where)
        streams, scored, why, where = best
        if why:
            return {"available": False, "why": why}
        rule = fixlib.EngineRule("vllm", a.get("target_arch") or "LlamaForCausalLM", int(a["num_layers"]))
        prop = fixlib.propose(draft, streams, rule, ids=a["config_ids"])
        out = {"available": True, "on": f"{where}, {scored}", "where": where, "scored_against": scored,
               **prop.as_dict()}
        fix_hs = rule.slots(a["fix_ids"]) if a.get("fix_ids") else None
        trained = a.get("trained")
        if a.get("fix_ids") is None and trained and len(trained) == draft.k and trained != sorted(trained) \
                and all(h in streams.by_hf for h in trained):
            # no id list gives the trained order (vLLM sorts the ids): the draft with its fc.weight column blocks
            # permuted to layer order, served the sorted ids, reads exactly what it reads on the trained order
            sc, cur = fixlib.replay(draft, streams, list(trained), prop.current.score.chain), prop.current.score
            out["permute_check"] = {"ids": sorted(trained), "streams": list(trained), "score": sc.as_dict(),
                                    "current": cur.as_dict()}
        if fix_hs is not None and len(fix_hs) == draft.k:
            # the ids the report's finding proposes, replayed: the acceptance they bring back, before serving them
            sc, cur = fixlib.replay(draft, streams, fix_hs, prop.current.score.chain), prop.current.score
            out["fix_check"] = {"ids": list(a["fix_ids"]), "streams": fix_hs, "score": sc.as_dict(),
                                "current": cur.as_dict(), "line": (
                                    f"replayed first-position acceptance {cur.first_position:.2f} -> "
                                    f"{sc.first_position:.2f} (accept length, chain of {sc.chain}: "
                                    f"{cur.accept_length:.2f} -> {sc.accept_length:.2f})")}
        return out
    except Exception as e:  # noqa: BLE001 - the replay is advice: its failure is said, the verdicts stand
        return {"available": False, "why": f"the draft replay failed: {type(e).__name__}: {e}"}


EMBED = "model.embed_tokens.weight"


def target_embedding(target, tmp: Path):
    """The target's embedding table written alone to a file in `tmp` (for a draft that shares it, as vLLM does
    when the draft has none), read from the target's safetensors without loading the rest; None when absent."""
    if not target or not Path(target).is_dir():
        return None
    from safetensors import safe_open
    from safetensors.torch import save_file
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if EMBED in st.keys():
                out = tmp / "embed.safetensors"
                save_file({"embed_tokens.weight": st.get_tensor(EMBED)}, str(out))
                return str(out)
    return None


# ---- SGLang: the draft replayed on the captured target forward ---------------------------------------------------
def add_sglang_replay(root: Path, rep: dict) -> None:
    """For an SGLang plugin capture with the draft's input (step-N-draft_input), when SGLang's acceptance is low
    or TPPROBE_FIX_REPLAY=1: the draft, its weights from the folder SGLang loaded, replayed on the streams of the
    target forward that fed it (step-N-MODE, every layer kept) for candidate id lists under SGLang's rule
    (tpprobe.eagle3.fix). `draft_replay` in the report, its line in the settings (every sink), and, when it
    recovers acceptance the served ids lose and nothing else fails, an `id-contract` failure with the ids."""
    import json

    from ..engines.vllm.acceptance import LOW
    steps = sorted(Path(root).rglob("step-*-draft_input/manifest.json"))
    if not steps:
        return
    acc = rep.get("acceptance") or {}
    rate = acc.get("rate")
    if not ((rate is not None and rate < LOW) or knob("TPPROBE_FIX_REPLAY") == "1"):
        return
    m = steps[0].parent
    s = json.loads(steps[0].read_text()).get("settings") or {}
    rp = sglang_replay(m, s)
    rep["draft_replay"] = rp
    line = (f"fix (the draft replayed on {rp['on']}): {rp['line']}" if rp.get("available")
            else f"no fix proposed ({rp['why']})")
    rep["settings"] = {**(rep.get("settings") or {}), "draft replay": line}
    if rp.get("available") and rp.get("explained") and not any(
            f["severity"] == "failure" for f in rep.get("findings") or []):
        from ..checks.findings import Finding, exit_code
        said = f"SGLang's acceptance is {rate:.2f} and the draft" if rate is not None else "The draft"
        rep["findings"] = [Finding(
            "id-contract", f"aux slots, step {s.get('step')} ({s.get('forward_mode')})", list(range(
                int(s.get("world_size") or 1))),
            detail=f"{said}, replayed on {rp['on']}, reads other streams than its config gives it on SGLang "
                   f"({rp['written_ids']} -> HF hidden_states {rp['current']['streams']}): {rp['line']}",
            evidence={"all_ranks": True, "explain": "the engine captures what the draft's config says, but the "
                                                    "draft was trained on other streams (catalogue F32): only the "
                                                    "draft can tell, replayed on candidate captures"}).to_json(),
            *(rep.get("findings") or [])]
        rep["exit_code"] = exit_code(rep["findings"])


def sglang_replay(step: Path, s: dict) -> dict:
    """The replay of one draft_input step: {"available": False, "why"} when it cannot run."""
    import importlib
    import json
    try:
        fixlib = importlib.import_module("tpprobe.eagle3.fix")
    except ImportError:
        return {"available": False, "why": "the draft replay (tpprobe.eagle3.fix) is not in this build"}
    target_step = step.parent / str(s.get("target step") or "")
    if not s.get("draft_path") or not Path(s["draft_path"]).is_dir():
        return {"available": False, "why": f"the draft's folder is not known or not here ({s.get('draft_path')!r})"}
    if not target_step.is_dir():
        return {"available": False, "why": f"the target forward that fed the draft ({target_step.name}) was not kept"}
    try:
        from ..eagle3.accept.draft import load_draft
        from ..eagle3.target_head import score_on_target
        from ..core.errors import CaptureError, UsageError
        try:
            streams = fixlib.streams_from_capture(target_step, 0)
        except (CaptureError, UsageError) as e:
            return {"available": False, "why": f"{e} (keep the streams: TPPROBE_KEEP='*')"}
        meta = json.loads((step / "rank-000.json").read_text())
        reqs = [r for r in meta.get("requests") or [] if r.get("rows", 0) >= 3]
        where = f"{target_step.name}"
        if reqs:       # one request's rows: a batch is no token sequence (the next request's first token follows)
            r = max(reqs, key=lambda r: r["rows"])
            lo, hi = r["first_row"], r["first_row"] + r["rows"]
            streams = fixlib.streams_from_tensors(streams.input_ids[lo:hi], {h: v[lo:hi] for h, v in
                                                                             streams.by_hf.items()},
                                                  streams.num_layers, source=f"{where}, request {r['rid']}")
            where += f", request {r['rid']}'s rows {lo}..{hi - 1}"
        with tempfile.TemporaryDirectory() as tmp:
            draft = load_draft(s["draft_path"], target_embedding(s.get("target_path"), Path(tmp)))
        scored, why = score_on_target(streams, s.get("target_path"))
        if why:
            return {"available": False, "why": why}
        rule = fixlib.EngineRule("sglang", s.get("target_arch") or "LlamaForCausalLM", int(streams.num_layers))
        prop = fixlib.propose(draft, streams, rule, ids=s.get("draft_config_ids"))
        return {"available": True, "on": f"{where}, {scored}", "scored_against": scored, **prop.as_dict()}
    except Exception as e:  # noqa: BLE001 - the replay is advice: its failure is said, the verdicts stand
        return {"available": False, "why": f"the draft replay failed: {type(e).__name__}: {e}"}
