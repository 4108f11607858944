"""`tpprobe fix`: which EAGLE-3 ids to write for this draft on this engine, from the draft replayed on
candidate captures of the target's own streams (tpprobe.eagle3.fix says how).

Exit codes: 0 the ids as served replay as well as any candidate; 1 another capture replays better
(the ids to write, or what to patch when no id list gives it); 2 bad input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tpprobe.core.errors import UsageError


def fix_command(
    draft: Annotated[Path, typer.Option("--draft", help="EAGLE-3 draft checkpoint folder (config.json + "
                                                        "safetensors); weights read from its safetensors")],
    streams: Annotated[Path, typer.Option("--streams", help="a tpprobe capture folder with every layer's stream of "
                                                            "the target (tpprobe probe, or a plugin step folder)")],
    engine: Annotated[str, typer.Option("--engine", help="whose capture rule: sglang | vllm")] = "sglang",
    arch: Annotated[Optional[str], typer.Option("--arch", help="the target's architecture as in its config.json "
                                                               "(DeepseekV3ForCausalLM, LlamaForCausalLM)")] = None,
    target_config: Annotated[Optional[Path], typer.Option("--target-config", help="the target's config.json "
                                                                                  "(its architecture), or its folder "
                                                                                  "(the replay then scores the draft "
                                                                                  "against the target's own greedy "
                                                                                  "tokens)")] = None,
    ids: Annotated[Optional[str], typer.Option("--ids", help="the ids served (default: the draft config's "
                                                             "eagle_aux_hidden_state_layer_ids)")] = None,
    id_rule: Annotated[Optional[str], typer.Option("--id-rule", help="your build's capture rule for some ids, e.g. "
                                                                     "-1=embed (default: TPPROBE_ID_RULE; see "
                                                                     "tpprobe layers --help)")] = None,
    trained_on: Annotated[Optional[Path], typer.Option("--trained-on", help="a training sample (SpecForge) of the "
                                                                            "same tokens: its slots become a "
                                                                            "candidate")] = None,
    chain: Annotated[int, typer.Option("--chain", help="drafted tokens per step (num_speculative_tokens)")] = 5,
    rank: Annotated[int, typer.Option("--rank", help="which rank of the capture folder")] = 0,
    embed: Annotated[Optional[Path], typer.Option("--embed", help="the target's embedding table, when the draft "
                                                                  "has none: the target's folder (the replay then "
                                                                  "scores the draft against the target's own greedy "
                                                                  "tokens) or a file")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    html: Annotated[Optional[str], typer.Option("--html", help="also write a self-contained HTML report")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary")] = None,
) -> None:
    """Which EAGLE-3 ids to write: the draft replayed on candidate captures of the target's streams."""
    from tpprobe.engines.capture_rule import env_id_rule, parse_id_rule
    from tpprobe.engines.registry import rule_engine
    from tpprobe.engines.sglang.layer_ids import parse_ids
    from tpprobe.formats.capture_dir import check_file_path
    from tpprobe.report.emit import Flags, emit

    for flag, out in (("--html", html), ("--markdown", markdown)):
        if out:
            check_file_path(Path(out), flag)
    rule_engine(engine)          # an engine whose capture rule is tabulated, else one line
    if chain < 1:
        raise UsageError(f"--chain {chain}: give the drafted tokens per step, at least 1")
    rule = parse_id_rule(id_rule) if id_rule is not None else env_id_rule()
    num_layers = None
    if target_config is not None:
        arch, num_layers = _target(target_config, arch)
    if arch is None:
        raise UsageError("--arch or --target-config: give the target's architecture (e.g. DeepseekV3ForCausalLM) "
                         "so the engine's capture rule applies")
    from tpprobe.eagle3.fix import run_fix
    # the target's folder, when a flag names it: the replay scores the draft against the target's own greedy tokens
    target = next((str(p) for p in (embed, target_config) if p is not None and p.is_dir()), None)
    rep = run_fix(draft, streams, engine, arch, num_layers, parse_ids(ids), rule,
                  trained_on, rank, chain, str(embed) if embed else None, target)
    emit(fix_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown))
    raise typer.Exit(rep["exit_code"])


def _target(path: Path, arch: Optional[str]) -> tuple[str, int]:
    from tpprobe.config.hub import check_target
    check_target(path, "--target-config", "give the target model's config.json as --target-config (or its --arch); "
                                          "the draft's checkpoint folder goes to --draft")
    p = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--target-config {path}: cannot read a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--target-config {path}: not a JSON object; expected a HF config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    archs = text.get("architectures") or cfg.get("architectures") or []
    L = cfg.get("num_hidden_layers", text.get("num_hidden_layers"))
    if not isinstance(L, int) or L < 1:
        raise UsageError(f"--target-config {path}: no num_hidden_layers")
    if arch is None:
        if not archs:
            raise UsageError(f"--target-config {path}: no 'architectures'; give --arch")
        arch = archs[0]
    return arch, L


def fix_report(rep: dict):
    from tpprobe.eagle3.fix import SHOWN
    from tpprobe.engines.registry import rule_engine
    from tpprobe.report.model import Cell, Column, Report, Table, Text

    def s(c):
        return f"{c['score']['first_position']:.2f}", f"{c['score']['accept_length']:.2f}"
    rows = []
    for c in rep["candidates"][:SHOWN]:
        fp, al = s(c)
        rows.append([str(c["streams"]), "-" if c["ids"] is None else str(c["ids"]), fp, al, c["label"]])
    cur = rep["current"]
    chain = cur["score"]["chain"]
    t = Table(f"the draft replayed on candidate captures (teacher-forced, {rep['tokens']} tokens from "
              f"{rep['streams_from']}; first {SHOWN} of {len(rep['candidates'])})",
              [Column("slots = HF hidden_states"), Column("ids on this engine"),
               Column("first-position", justify="right"), Column(f"accept length (chain of {chain})",
                                                                 justify="right"), Column("candidate")], rows,
              caption=(f"now: ids {rep['written_ids']} -> HF hidden_states{cur['streams']} ({s(cur)[0]} "
                       f"first-position, accept length {s(cur)[1]})" if cur["streams"] else
                       f"now: ids {rep['written_ids']} are not served as they are (see the note): nothing accepted"))
    head = (f"{rule_engine(rep['engine']).title} {rep['arch']}, {rep['num_layers']} layers"
            + (f", your build: {rep['id_rule']}" if rep["id_rule"] else "") + f" · draft {rep['draft']}")
    level = "failure" if rep["exit_code"] else "ok"
    word = "FIX" if rep["fix_ids"] is not None else ("NO ID LIST FITS" if rep["no_fix"] else "OK")
    sections = [Text(parts=[Cell("tpprobe fix", style="bold"), Cell(f" — {head}")]), t,
                Text(f"replay {rep['scored_against']}")]
    sections += [Text(f"note: {n}") for n in rep["notes"]]
    sections.append(Text(parts=[Cell(word, level), Cell(f": {rep['line']}")]))
    return Report("tpprobe.fix/1", f"tpprobe fix: {word}", rep, verdict=[Cell(f"{word}: {rep['line']}", level)],
                  sections=sections, exit_code=rep["exit_code"], to_json=lambda x: json.dumps(x, indent=1))
