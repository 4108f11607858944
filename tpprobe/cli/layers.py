"""`tpprobe layers`: what each EAGLE-3 layer id captures under SGLang's rule for an architecture,
and (with --draft-config/--target-config) whether a draft and its target agree on the contract.

No model is run, and SGLang is not needed: the rules of SGLang 0.5.23's architectures are
tabulated from its code (tpprobe/engines/sglang/rules_table.py); with another SGLang release installed, they
are derived from that release's code (tpprobe.engines.sglang.rules).

Exit codes: 0 every id captures one slot the draft can use / draft and target agree; 1 a crash,
a dropped or duplicate id, or (contract) any slot that differs, ids out of layer order (F30) or an id
beyond the last layer (F31) on either engine (tpprobe.engines.before_serving); 2 bad input, or an
architecture whose rule is not in SGLang's code (its setter hands the ids to an object built elsewhere:
MindSporeForCausalLM) and no `--id-rule` for every id (`--arch all` lists it as not checked).

With a contract that differs, the ids to write for this draft on this engine (or why no id list
gives what it expects, and which engine function to patch): tpprobe.engines.capture_rule.ids_to_write.
`--id-rule` (default: TPPROBE_ID_RULE) describes a patched build, e.g. `-1=embed`; every rule goes
through tpprobe.engines.capture_rule.plan_for.

The contract (catalogue F19). SGLang's target side reads the layer ids ONLY from the draft's
`eagle_config.eagle_aux_hidden_state_layer_ids` (spec_aux_hidden_state.py
`_resolve_eagle_aux_hidden_state`); when absent it uses the target model's default. The draft
side sizes its fc layer from `num_aux_hidden_states`, the nested ids, or a top-level
`eagle_aux_hidden_state_layer_ids` (llama_eagle3.py, kimi_k25_eagle3.py). What the draft was
trained on is read in the convention of --draft-convention: `output` (SpecForge's: id k = the
output of layer k = HF hidden_states[k+1], -1 = the embedding) or `before` (the capture-before
convention of sglang#25454: id k = HF hidden_states[k]). Without ids the draft is taken to
expect SGLang's default capture points [2, L//2, L-3].
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tpprobe.core.errors import UsageError

ARCH_HELP = ("SGLang architecture: the class in config.json's `architectures` (LlamaForCausalLM, "
             "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM, ...), an SGLang model file "
             "(llama, qwen3, qwen3_moe, deepseek_v2, gpt_oss, ...), a model_type or alias (deepseek_v3, "
             "kimi_k2, kimi); `all` = one line per architecture")


ID_RULE_HELP = ("your build's capture of some ids, on top of --engine's stock rule: ID=WHAT, comma-separated, WHAT "
                "= embed | out:K (layer K's output) | in:K (the stream entering layer K) | hs:N (HF hidden_states[N]); "
                "e.g. -1=embed for an SGLang patched so that id -1 is the embedding output (default: the "
                "TPPROBE_ID_RULE environment variable, which the plugins read too)")


def layers_command(
    arch: Annotated[str, typer.Option("--arch", help=ARCH_HELP)] = "llama",
    ids: Annotated[Optional[str],
                   typer.Option("--ids", help="EAGLE-3 layer ids, e.g. -1,2,30 (default: SGLang's)")] = None,
    num_layers: Annotated[int, typer.Option("--num-layers", help="decoder layers of the target")] = 61,
    draft_config: Annotated[Optional[Path],
                            typer.Option("--draft-config", help="the EAGLE-3 draft's config.json: check its layer-id "
                                                                "contract against --target-config")] = None,
    target_config: Annotated[Optional[Path],
                             typer.Option("--target-config",
                                          help="the target model's config.json: its architecture and num_hidden_layers "
                                               "replace --arch and --num-layers (alone: what --ids capture on it)")
                             ] = None,
    draft_convention: Annotated[str,
                                typer.Option("--draft-convention",
                                             help="what the draft's ids meant in training: output (id k = output of "
                                                  "layer k, SpecForge) | before (id k = input of layer k)")] = "output",
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    engine: Annotated[str, typer.Option("--engine", help="whose capture rule: sglang | vllm (vLLM's ids are used "
                                                         "as written: id k = HF hidden_states[k])")] = "sglang",
    vllm_runner: Annotated[Optional[str],
                           typer.Option("--vllm-runner", help="with --draft-config: the vLLM model runner that reads "
                                                              "the draft's ids: v2 (GPU default) | v1 (CPU); default "
                                                              "v2")] = None,
    html: Annotated[Optional[str],
                    typer.Option("--html", help="also write a self-contained HTML report to this file")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary (for an issue) "
                                                                       "to this file")] = None,
    id_rule: Annotated[Optional[str], typer.Option("--id-rule", help=ID_RULE_HELP)] = None,
) -> None:
    """What each EAGLE-3 layer id really captures under SGLang's (or vLLM's) rules (no model is run)."""
    from tpprobe.engines.sglang.layer_ids import parse_ids
    from tpprobe.report.emit import Flags, emit

    for flag, path in (("--html", html), ("--markdown", markdown)):
        if path:
            from tpprobe.formats.capture_dir import check_file_path
            check_file_path(Path(path), flag)
    from tpprobe.engines.registry import rule_engine
    flags = Flags(json_out=json_out, html=html, markdown=markdown)
    eng = rule_engine(engine)
    serves_vllm = bool(eng.model_runners) or vllm_runner is not None     # the vLLM runner's note is for them
    vllm_runner = vllm_runner or "v2"
    if vllm_runner not in ("v1", "v2"):
        raise UsageError(f"--vllm-runner {vllm_runner!r}: use v1 or v2")
    from tpprobe.engines.capture_rule import env_id_rule, parse_id_rule
    rule = parse_id_rule(id_rule) if id_rule is not None else env_id_rule()
    if target_config is not None and draft_config is None:
        # the target alone: its own architecture and depth under the engine's rule, for --ids (or its defaults)
        hub = _target(target_config)
        rep = plan_report(hub.architecture, parse_ids(ids), hub.num_layers, engine, rule)
    elif draft_config is not None or target_config is not None:
        if target_config is None:
            raise UsageError("--draft-config needs --target-config: give the target model's config.json too (the "
                             "draft's ids are read against its architecture and depth)")
        res = contract(draft_config, target_config, draft_convention, vllm_runner, engine, rule)
        res["engines"]["serves_vllm"] = serves_vllm
        rep = contract_report(res)
    elif arch.strip().lower() == "all":
        rep = all_report(eng.all_layer_rows(parse_ids(ids), num_layers), parse_ids(ids), num_layers, engine)
    else:
        rep = plan_report(arch, parse_ids(ids), num_layers, engine, rule)
    emit(rep, None, flags)
    raise typer.Exit(rep.exit_code)


def _json(doc) -> str:
    return json.dumps(doc, indent=1)


# ---- one architecture --------------------------------------------------------------------
def plan_report(arch: str, ids: Optional[list[int]], num_layers: int, engine: str = "sglang",
                id_rule: Optional[dict] = None):
    """What SGLang's (or vLLM's) rule for `arch` makes of `ids`: the plan's table and its problems."""
    from tpprobe.engines.capture_rule import plan_for
    from tpprobe.engines.registry import rule_engine
    from tpprobe.report.model import Cell, Report, Text
    from tpprobe.report.sglang_plan import plan_table
    from tpprobe.report.vllm_plan import vllm_plan_table

    p = plan_for(engine, arch, ids, num_layers, id_rule)
    # the table of a rule that moves ids (SGLang's +1), or of ids as written (vLLM's)
    table = (plan_table if rule_engine(engine).offset_rule else vllm_plan_table)(p)
    doc = {"arch": arch, "class": p.sglang_class, "rule": p.rule, "source": p.source,
           "layers_to_capture": p.layers_to_capture, "slots": p.slot_hf_indices,
           "crash": p.crash, "problems": p.problems, "rows": [r.__dict__ for r in p.rows]}
    sections = [table]
    if p.problems:
        sections.append(Text(parts=[Cell("PROBLEM", "failure"), Cell(f": {'; '.join(p.problems)}")]))
        verdict = [Cell(f"PROBLEM: {x}", "failure") for x in p.problems]
    else:
        verdict = [Cell(f"every id captures one slot the draft can use: aux slots = HF hidden_states"
                        f"{p.slot_hf_indices}", "ok")]
    given = "default" if ids is None else ",".join(map(str, ids))
    return Report("tpprobe.layers/1", f"tpprobe layers: {arch}, {num_layers} layers, ids {given}", doc,
                  verdict=verdict, sections=sections, settings={"arch": arch, "ids": given, "num_layers": num_layers},
                  exit_code=1 if p.problems else 0, to_json=_json)


# ---- every architecture ------------------------------------------------------------------
def all_report(rows: list[dict], ids, num_layers: int, engine: str = "sglang"):
    """One row per architecture: what SGLang's (or vLLM's) rule captures for `ids`, and any problem."""
    from tpprobe.report.model import Cell, Column, Report, Table, Text

    from tpprobe.engines.registry import rule_engine

    given = "default" if ids is None else ",".join(map(str, ids))
    eng = rule_engine(engine)
    name, how = eng.title, eng.rules_source()
    t = Table(f"EAGLE-3 capture of every {name} architecture, ids {given}, {num_layers} layers ({how})",
              [Column(c) for c in ("architecture", "file", "layers_to_capture", "aux slots = HF hidden_states[...]",
                                   "problem")],
              [[r["arch"], r["file"], "?" if r.get("outside") else str(r["layers_to_capture"]),
                "?" if r.get("outside") else str(r["slots"]),
                Cell("; ".join(r["problems"]), "failure") if r["problems"] else
                Cell("not checked: its rule is outside SGLang's code", "warning") if r.get("outside") else
                Cell("-", "ok")] for r in rows])
    bad = [r for r in rows if r["problems"]]
    unread = [r["arch"] for r in rows if r.get("outside") and not r["problems"]]
    checked = len(rows) - len(unread)
    also = (f"; not checked: {', '.join(unread)} (its rule is outside SGLang's code: `tpprobe layers --arch "
            f"{unread[0]}` says where)" if unread else "")
    verdict = ([Cell(f"{r['arch']}: {'; '.join(r['problems'])}", "failure") for r in bad]
               + ([Cell(f"not checked: {', '.join(unread)} (its rule is outside SGLang's code)", "warning")]
                  if bad and unread else [])
               or [Cell(f"every architecture checked captures one usable slot per id ({checked} of {len(rows)} "
                        f"architectures{also})" if unread else
                        f"every architecture captures one usable slot per id ({len(rows)} architectures)", "ok")])
    # the verdict under the table too: the terminal draws sections only
    word = {"failure": "PROBLEM", "warning": "NOTE", "ok": "OK"}
    lines = [Text(parts=[Cell(word[v.level], v.level), Cell(f": {v.text}")]) for v in verdict]
    return Report("tpprobe.layers/1", f"tpprobe layers: every {name} architecture, ids {given}, {num_layers} layers",
                  rows, verdict=verdict, sections=[t, *lines], settings={"ids": given, "num_layers": num_layers},
                  exit_code=1 if bad else 0, to_json=_json)


def _target(target_path: Path):
    """A target's config.json (a wrapper's text model under text_config too) with its architecture and depth, or
    one line why not."""
    from tpprobe.config.hub import check_target, read_config

    check_target(target_path, "--target-config", "give the target model's config.json as --target-config and the "
                                                 "draft's as --draft-config")
    hub = read_config(target_path, "--target-config")
    if not hub.architecture:
        raise UsageError(f"--target-config {target_path}: no 'architectures' list; expected the target "
                         f"model's HF config.json")
    if hub.num_layers is None:
        raise UsageError(f"--target-config {target_path}: no num_hidden_layers (nor under text_config)")
    return hub


# ---- the draft / target contract (F19) ---------------------------------------------------
def _read(path: Path, what: str) -> dict:
    """A config.json's dict, read by the one reader (tpprobe.config.hub): one line when it cannot be read."""
    from tpprobe.config.hub import read_config
    return read_config(path, f"--{what}").raw


def _int_list(v, where: str) -> Optional[list[int]]:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise UsageError(f"{where} must be a list of integers, got {v!r}")
    return list(v)


def contract(draft_path: Path, target_path: Path, convention: str = "output", vllm_runner: str = "v2",
             engine: str = "sglang", id_rule: Optional[dict] = None) -> dict:
    """Slot by slot: what the draft was configured to receive vs what the target captures on `engine`
    (with `id_rule`: a patched build's capture of some ids, tpprobe.engines.capture_rule)."""
    from tpprobe.capture.points import point_label
    from tpprobe.checks.slots import slot_verdict
    from tpprobe.engines.capture_rule import plan_for
    from tpprobe.engines.sglang.layer_ids import layer_point

    if convention not in ("output", "before"):
        raise UsageError(f"--draft-convention {convention!r}: use output or before")

    draft = _read(draft_path, "draft-config")
    check_is_draft(draft, draft_path, target_path)
    hub = _target(target_path)
    L = hub.num_layers
    eagle = draft.get("eagle_config") if isinstance(draft.get("eagle_config"), dict) else None
    nested = _int_list((eagle or {}).get("eagle_aux_hidden_state_layer_ids"),
                       f"{draft_path}: eagle_config.eagle_aux_hidden_state_layer_ids")
    top = _int_list(draft.get("eagle_aux_hidden_state_layer_ids"),
                    f"{draft_path}: eagle_aux_hidden_state_layer_ids")
    notes = []
    draft_ids = nested if nested is not None else top
    if draft_ids is not None:
        shift = 1 if convention == "output" else 0
        want = [i + shift for i in draft_ids]           # HF hidden_states index per draft slot
        conv = ("id k = the output of layer k = HF hidden_states[k+1]" if shift
                else "id k = the input of layer k = HF hidden_states[k]")
    else:
        want = [2, L // 2, L - 3]
        conv = "no ids in the draft config: SGLang's default capture points [2, L//2, L-3]"
    k_draft = draft.get("num_aux_hidden_states")
    if isinstance(k_draft, int) and k_draft != len(want):
        notes.append(f"the draft's num_aux_hidden_states is {k_draft} but its ids name {len(want)} slots: its fc "
                     f"layer takes {k_draft} × hidden")
    # the ids the engine's target side reads (SGLang: only the nested ids; vLLM: its model runner's reader)
    from tpprobe.engines.registry import rule_engine
    eng = rule_engine(engine)
    target_ids, read_notes = eng.served_ids(draft, vllm_runner)
    notes += read_notes
    p = plan_for(engine, hub.architecture, target_ids, L, id_rule)     # the rules know the wrappers they serve
    per_id = bool(p.crash) and target_ids is not None and draft_ids is not None and list(target_ids) == draft_ids
    rows, differences = [], []
    if per_id:     # the engine crashes: what every id would capture, so the other ids' shifts stay visible
        for i, (w, r) in enumerate(zip(want, p.rows)):
            g = r.hf_index if r.captured else None
            wp = layer_point(w) if 0 <= w <= L else None
            gp = layer_point(g) if g is not None and 0 <= g < L else None
            ok = g is not None and g == w
            # the draft's slot i (the engine's own slot order is not reached: it crashes), as in the engines' table
            row = {"slot": i, "draft_id": draft_ids[i], "draft_expects": _hs(w, L),
                   "draft_expects_point": wp, "target_point": gp, "ok": ok,
                   "target_captures": _hs(g, L) if g is not None else "nothing: the engine crashes"}
            rows.append(row)
            if not ok:
                differences.append(f"id {draft_ids[i]}: the draft expects {row['draft_expects']} "
                                   f"({point_label(wp) if wp else 'nothing the target has'}), the target captures "
                                   f"{row['target_captures']}" + (f" ({point_label(gp)})" if gp else ""))
    else:
        got = [] if p.crash else p.slot_hf_indices
        for i in range(max(len(want), len(got))):
            w = want[i] if i < len(want) else None
            g = got[i] if i < len(got) else None
            wp = layer_point(w) if w is not None and 0 <= w <= L else None
            gp = layer_point(g) if g is not None else None
            ok = w is not None and g is not None and w == g and 0 <= w <= L
            row = {"slot": i, "draft_id": draft_ids[i] if draft_ids and i < len(draft_ids) else None,
                   "draft_expects": _hs(w, L), "draft_expects_point": wp,
                   "target_captures": _hs(g, L) if g is not None else "nothing",
                   "target_point": gp, "ok": ok}
            rows.append(row)
            if not ok:
                differences.append(f"slot {i}: the draft expects {row['draft_expects']} "
                                   f"({point_label(wp) if wp else 'nothing the target has'}), the target captures "
                                   f"{row['target_captures']}" + (f" ({point_label(gp)})" if gp else ""))
    verdict = None
    if differences and not p.crash:
        ids_for = [r["draft_id"] for r in rows]
        v = slot_verdict(ids_for, [r["draft_expects_point"] for r in rows][:len(want)],
                          [r["target_point"] for r in rows if r["target_point"]], L, offset_rule=eng.offset_rule)
        if v:
            verdict = {"kind": v[0], "where": v[1], "detail": v[2]}
    elif differences and per_id:
        both = [r for r in rows if r["target_point"] and r["draft_expects_point"]]
        if both:
            v = slot_verdict([r["draft_id"] for r in both], [r["draft_expects_point"] for r in both],
                             [r["target_point"] for r in both], L, offset_rule=eng.offset_rule,
                             numbers=[r["slot"] for r in both])
            if v:
                verdict = {"kind": v[0], "where": "ids " + ", ".join(str(r["draft_id"]) for r in both),
                           "detail": v[2] + " (besides the crash)"}
    if p.crash:
        differences.insert(0, f"the target crashes with these ids: {p.crash}")
    from tpprobe.engines.capture_rule import ids_to_write
    proposal = ids_to_write(engine, hub.architecture, L, want, draft_ids, id_rule) if differences else None
    from tpprobe.engines.ids_compare import compare

    try:
        engines = compare(draft, hub.architecture, L, convention, vllm_runner, text_arch=hub.text_architecture,
                          id_rules={engine: id_rule} if id_rule else None)
    except UsageError as e:      # an architecture one engine does not know: said in the engines' view
        engines = {"verdict": None, "error": str(e), "rows": [], "notes": [str(e)]}
    if hub.wrapper:
        notes.append(f"the target is {hub.describe()}: the EAGLE-3 states are that text model's "
                     f"(SGLang's rule: {p.sglang_class}'s)")
    from tpprobe.engines.before_serving import findings
    hidden = hub.get("hidden_size")
    serving = findings(draft, hub.architecture, L, hidden if isinstance(hidden, int) else None, id_rule,
                       {engine} if id_rule else None)
    return {"engines": engines, "before_serving": serving, "proposal": proposal, "engine": engine,
            "id_rule": id_rule or {}, "draft": str(draft_path), "target": str(target_path),
            "target_arch": hub.architecture, "target_text_arch": hub.text_architecture,
            "target_class": p.sglang_class, "num_layers": L, "draft_ids": draft_ids,
            "draft_convention": conv, "target_ids": target_ids, "target_rule": p.rule,
            "target_layers_to_capture": p.layers_to_capture, "rows": rows, "notes": notes,
            "differences": differences, "verdict": verdict, "finding": "id-contract" if differences else None}


def check_is_draft(draft: dict, draft_path: Path, target_path: Path) -> None:
    """UsageError when --draft-config is not an EAGLE-3 draft's config: the target's own file, or a model's
    config with no trace of a draft (no Eagle class, no eagle_config or aux ids, no draft_vocab_size, more
    than the draft's one decoder layer), whose contract would be SGLang's default against itself."""
    same = Path(draft_path).resolve() == Path(target_path).resolve()
    from tpprobe.config.hub import draft_sign
    archs = [a for a in draft.get("architectures") or [] if isinstance(a, str)]
    drafty = draft_sign(draft) is not None
    L = draft.get("num_hidden_layers")
    if same or not (drafty or L in (None, 1)):
        what = f"{archs[0] if archs else 'a'} model" + (f" of {L} layers" if isinstance(L, int) else "")
        raise UsageError(f"--draft-config {draft_path} is {'the --target-config itself' if same else 'a ' + what}, "
                         f"not an EAGLE-3 draft's config (an Eagle3 class of one layer, with eagle_config or its "
                         f"aux layer ids): give the draft's config.json as --draft-config and the target's as "
                         f"--target-config")


def _hs(i: Optional[int], L: int) -> str:
    if i is None:
        return "nothing"
    if i == L:
        return f"HF hidden_states[{L}] (the last layer's output)"
    if not 0 <= i <= L:
        return f"HF hidden_states[{i}] (does not exist: 0..{L})"
    return f"HF hidden_states[{i}]"


def contract_report(res: dict):
    """The contract slot by slot, its notes and its verdict."""
    from tpprobe.report.model import Cell, Column, Report, Table, Text

    t = Table(f"EAGLE-3 contract: draft {res['draft']} vs target {res['target']} "
              f"({res['target_arch']}, {res['num_layers']} layers)",
              [Column(c) for c in ("slot", "draft id", "draft expects", "target captures", "")],
              [[str(r["slot"]), "-" if r["draft_id"] is None else str(r["draft_id"]), r["draft_expects"],
                r["target_captures"], Cell("same", "ok") if r["ok"] else Cell("DIFFERS", "failure")]
               for r in res["rows"]],
              caption=f"draft: {res['draft_convention']}; target: {res['target_rule']}")
    sections: list = [t] + [Text(f"note: {n}") for n in res["notes"]]
    if res["differences"]:
        v = res["verdict"]
        head = "FAILURE id-contract" + (f" ({v['kind']} at {v['where']})" if v else "")
        line = Cell(f"{head}: " + "; ".join(res["differences"]), "failure")
        sections.append(Text(parts=[Cell(head, "failure"), Cell(": " + "; ".join(res["differences"]))]))
        if v:
            sections.append(Text(f"  {v['detail']}"))
    else:
        line = Cell("the draft and the target agree on every slot", "ok")
        sections.append(Text(line.text, "ok"))
    from tpprobe.report.vllm_plan import engines_sections
    eng = res["engines"]
    sections += engines_sections(eng)
    verdict = [line] + ([Cell(f"FAILURE engine-id-mismatch: {eng['verdict']}", "failure")]
                        if eng.get("verdict") else [])
    # the ids to write: on --engine (with its build's rule), then on each other engine the table shows not giving the
    # draft what it expects
    props = [res.get("proposal")] + [p for e, p in sorted((eng.get("fixes") or {}).items()) if e != res["engine"]]
    for prop in props:
        if not prop:
            continue
        word = "FIX" if prop["ids"] is not None else "NO ID LIST FITS"
        sections.append(Text(parts=[Cell(word, "failure"), Cell(f": {prop['line']}")]))
        verdict.append(Cell(f"{word}: {prop['line']}", "failure"))
    for f in res.get("before_serving") or []:
        head = f"FAILURE {f['kind']} ({f['fault']})"
        sections.append(Text(parts=[Cell(head, "failure"), Cell(f": {f['line']}")]))
        verdict.append(Cell(f"{head}: {f['line']}", "failure"))
    return Report("tpprobe.layers/1", f"tpprobe layers: EAGLE-3 contract of {res['draft']} and {res['target']}", res,
                  verdict=verdict, sections=sections,
                  settings={"draft": res["draft"], "target": res["target"], "convention": res["draft_convention"]},
                  exit_code=1 if res["differences"] or eng.get("verdict") or res.get("before_serving") else 0,
                  to_json=_json)
