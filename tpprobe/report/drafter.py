"""The EAGLE-3 drafter's section of a live capture's report: what the draft receives, vLLM's acceptance, the fix.

Built from the report document's `drafter` (tpprobe.engines.vllm.acceptance.analyse, plus the replay's
proposal): the acceptance table (the run so far and each captured step: drafts, draft tokens, accepted per
position, rate, mean acceptance length), the slot table (what each slot holds, what vLLM's rule gives, what
the draft was trained on) and the fix line. Every sink draws the same sections (terminal, HTML, Markdown);
JSON holds the document.
"""
from __future__ import annotations

from .model import Block, Cell, Column, Table, Text


def _f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def acceptance_line(a: dict) -> str:
    run = a.get("run")
    if not run:
        return "vLLM's acceptance: not counted (no verification ran while the plugin was attached)"
    per = ", ".join(f"{x}" for x in run.get("accepted_per_pos") or [])
    return (f"vLLM's acceptance, run so far: {run['drafts']} drafts, {run['draft_tokens']} draft tokens, "
            f"{run['accepted']} accepted (per position: {per or '—'}); rate {_f(run.get('rate'))}, mean acceptance "
            f"length {_f(run.get('mean_acceptance_length'))}")


def fix_line(a: dict) -> str:
    rp = a.get("replay")
    if a.get("fix_replayed"):       # the training's fix, with what the replay found (the finding says the same)
        return f"fix: {a['fix']} (the replay {rp.get('scored_against')})"
    if a.get("fix") and rp and (rp.get("fix_check") or {}).get("line"):
        return f"fix: {a['fix']}: the draft replayed on {rp.get('on')} with these ids: {rp['fix_check']['line']}"
    if rp and rp.get("available"):
        return f"fix (the draft replayed on {rp.get('on')}): {rp.get('line')}"
    if a.get("fix"):
        return f"fix: {a['fix']}" + (f" (replay: {rp['why']})" if rp and rp.get("why") else "")
    if rp and rp.get("why"):
        return f"fix: none proposed ({rp['why']})"
    return ""


def _acceptance_table(a: dict) -> Table:
    rows = []
    run = a.get("run")
    if run:
        rows.append(["run so far", str(run["drafts"]), str(run["draft_tokens"]), str(run["accepted"]),
                     ", ".join(map(str, run.get("accepted_per_pos") or [])) or "—",
                     Cell(_f(run.get("rate")), "failure" if a.get("low") else "ok"),
                     _f(run.get("mean_acceptance_length"))])
    for s in a.get("steps") or []:
        x = s.get("acceptance")
        if not x or not x.get("draft_tokens"):
            continue
        rows.append([f"step {s['step']} ({s['forward_mode']})", str(x["drafts"]), str(x["draft_tokens"]),
                     str(x["accepted"]), ", ".join(map(str, x.get("accepted_per_pos") or [])) or "—",
                     _f(x.get("rate")), _f(x.get("mean_acceptance_length"))])
    return Table("vLLM's EAGLE-3 acceptance (its rejection sampler's verification)",
                 [Column(c) for c in ("when", "drafts", "draft tokens", "accepted", "accepted per position", "rate",
                                      "mean acceptance length")], rows, terminal={"header_style": "bold"})


def _slot_table(a: dict) -> Table:
    first = (a.get("steps") or [{}])[0]
    trained = a.get("trained")
    rule = sorted(set(a.get("config_ids") or []))
    rows = []
    for s in first.get("slots") or []:
        j = s["slot"]
        want = rule[j] if j < len(rule) else None
        t = trained[j] if trained and j < len(trained) else None
        holds = s.get("holds") or "no stream"
        ok_rule = s.get("id") == want
        ok_train = t is None or s.get("id") == t
        rows.append([str(j), Cell(holds, "ok" if ok_rule and ok_train else "failure"), f"id {want}",
                     "unknown" if trained is None else f"HF hidden_states[{t}]",
                     Cell("yes" if ok_train and trained is not None else ("?" if trained is None else "NO"),
                          "ok" if trained is not None and ok_train else ("warning" if trained is None else "failure"))])
    return Table(f"what the draft receives (step {first.get('step')}, target_hidden_states "
                 f"[{first.get('rows')} × {first.get('width')}], ranks {first.get('ranks')}"
                 + (f"; ranks {first['ranks_differ']} differ" if first.get("ranks_differ") else "; equal on every rank")
                 + ")", [Column(c) for c in ("slot", "holds", "vLLM's rule", "trained on", "as trained")], rows,
                 caption=f"draft config ids {a.get('config_ids')}; trained on: {a.get('trained_from')}",
                 terminal={"header_style": "bold"})


def drafter_sections(doc: dict, media: tuple) -> list:
    """The drafter's sections for `media` (one sink's), or [] when the report has none."""
    a = doc.get("drafter")
    if not a:
        return []
    body = [Text(acceptance_line(a), level="failure" if a.get("low") else None), _acceptance_table(a),
            _slot_table(a)]
    fl = fix_line(a)
    if fl:
        body.append(Text(fl, style="bold"))
    if media == ("terminal",):
        out = [Text("EAGLE-3 drafter (vLLM)", style="bold", heading=True), *body]
    elif media == ("markdown",):
        out = [Text(acceptance_line(a), tag="p")] + ([Text(fl, tag="p")] if fl else [])
    else:
        out = [Block("drafter", "EAGLE-3 drafter: what it receives and vLLM's acceptance", body)]
    for s in out:
        s.media = media
        for b in getattr(s, "body", []):
            b.media = media
    return out
