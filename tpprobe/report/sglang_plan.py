"""The SGLang EAGLE-3 layer plan as a report section (`tpprobe layers`, the probe's SGLang runs).

What SGLang's capture rules make of a set of layer ids is computed here, by the section builder,
before anything is drawn: renderers only lay the Table out.
"""
from __future__ import annotations

from typing import Optional

from ..engines.sglang.layer_ids import SGLANG_VERSION, LayerPlan, plan, point_of
from .model import Cell, Column, Report, Table, Text

STATUS_LEVEL = {"ok": "ok", "dropped": "warning", "crash": "failure"}
# the SGLang architectures the probe builds (--engine sglang --arch ...): their runs show the plan
PROBE_ARCHS = ("llama", "deepseek_v2", "qwen3", "qwen3_moe", "qwen2")


def plan_table(p: LayerPlan) -> Table:
    """`p` as a Table: one row per id (what SGLang captures for it, which aux slot, what it physically is)."""
    given = "default" if p.ids is None else ",".join(str(i) for i in p.ids)
    right = [Column(c, justify="right") for c in ("id", "layers_to_capture", "capture point", "aux slot")]
    return Table(
        title=f"SGLang {SGLANG_VERSION} EAGLE-3 capture, arch {p.arch}, {p.num_layers} layers, ids {given}",
        caption=f"{p.rule}. layers_to_capture={p.layers_to_capture}; packed aux = {p.num_slots} slot(s) of "
                f"hidden_size, same full tensor on every TP rank" + (f". CRASH: {p.crash}" if p.crash else ""),
        columns=right + [Column("what it physically is"), Column("status"), Column("note")],
        rows=[["-" if r.requested is None else str(r.requested), str(r.layer), point_of(r.layer, p.num_layers),
               "-" if r.slot is None else str(r.slot), r.what,
               Cell(r.status or "-", STATUS_LEVEL.get(r.status), None if r.status in STATUS_LEVEL else ""),
               r.note] for r in p.rows])


def probe_plan_sections(settings: dict) -> list:
    """The plan of a probe run on SGLang's own model (not vLLM's rule): its table, or one dim line
    when it cannot be made (a table is a courtesy: it never breaks the report)."""
    from ..engines.registry import recorded
    if settings.get("arch") not in PROBE_ARCHS or settings.get("layer_ids") is None \
            or not recorded(settings).offset_rule:
        return []
    try:
        return [plan_table(plan(settings["arch"], list(settings["layer_ids"]), int(settings["num_layers"])))]
    except Exception as e:
        return [Text(f"(layer-id table unavailable: {e})", style="dim", media=("terminal",))]


def render_layers_table(arch: str, ids: Optional[list[int]], num_layers: int, console=None) -> LayerPlan:
    """Print the plan's table on `console` (a rich Console; default stdout)."""
    from rich.console import Console

    from .terminal import draw
    p = plan(arch, ids, num_layers)
    draw(Report("tpprobe.layers/1", "", None, sections=[plan_table(p)]), console or Console())
    return p
