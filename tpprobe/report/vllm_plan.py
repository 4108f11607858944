"""vLLM's EAGLE-3 layer plan and both engines side by side, as report sections (`tpprobe layers --engine vllm`,
`--draft-config/--target-config`).

What vLLM's rule (and SGLang's beside it) makes of a draft's ids is computed before anything is drawn
(tpprobe/engines/vllm/layer_ids.py, tpprobe/engines/ids_compare.py); these builders only lay it out as Tables.
"""
from __future__ import annotations

from .model import Cell, Column, Table, Text



def _given(ids) -> str:
    """An engine's ids as the caption says them: `not given` where it reads none (its default follows)."""
    return "not given" if ids is None else str(ids)

def vllm_plan_table(p) -> Table:
    """vLLM's plan as a Table (vLLM's columns: the id as vLLM holds it is the capture point)."""
    from ..engines.sglang.layer_ids import layer_point
    from ..engines.vllm.layer_ids import version
    given = "default" if p.ids is None else ",".join(str(i) for i in p.ids)
    status = {"ok": "ok", "dropped": "warning", "duplicate": "warning", "crash": "failure"}
    return Table(
        title=f"vLLM {version()} EAGLE-3 capture, arch {p.arch}, {p.num_layers} layers, ids {given}",
        caption=f"{p.rule}. aux_hidden_state_layers={tuple(p.layers_to_capture)}; packed aux = {p.num_slots} slot(s) "
                f"of hidden_size" + (f". CRASH: {p.crash}" if p.crash else ""),
        columns=[Column(c, justify="right" if c in ("id", "aux slot") else "left")
                 for c in ("id", "capture point", "aux slot", "what it physically is", "status", "note")],
        rows=[["-" if r.requested is None else str(r.requested),
               layer_point(r.hf_index) if r.hf_index is not None else "-", "-" if r.slot is None else str(r.slot),
               r.what, Cell(r.status or "-", status.get(r.status), None if r.status in status else ""), r.note]
              for r in p.rows])


def engines_sections(res: dict) -> list:
    """Both engines side by side for one draft: the table, its notes and its one verdict line."""
    if res.get("error"):
        return [Text(f"note: both engines side by side: {res['error']}")]

    def hs(i):
        return "nothing" if i is None else f"hidden_states[{i}]"
    t = Table(f"EAGLE-3 draft on both engines: target {res['target_arch']}, {res['num_layers']} layers "
              f"(vLLM {res['vllm_runner']} model runner)",
              [Column(c) for c in ("slot", "draft id", "draft expects", "SGLang captures", "vLLM captures", "")],
              [[str(r["slot"]), "-" if r["draft_id"] is None else str(r["draft_id"]),
                "-" if r["draft_expects"] is None else hs(r["draft_expects"]), hs(r["sglang"]), hs(r["vllm"]),
                Cell("same", "ok") if r["same"] else Cell("DIFFERS", "failure")] for r in res["rows"]],
              caption=f"SGLang ids {_given(res['sglang_ids'])} ({res['sglang_ids_from']}); vLLM ids "
                      f"{_given(res['vllm_ids'])} ({res['vllm_ids_from']}); draft trained with "
                      f"{res['draft_convention']}")
    shown = [n for n in res["notes"] if n != res.get("runner_note") or res.get("serves_vllm")]
    out: list = [t] + [Text(f"note: {n}") for n in shown]
    if res["verdict"]:
        out.append(Text(parts=[Cell("FAILURE engine-id-mismatch", "failure"), Cell(f": {res['verdict']}")]))
    else:
        out.append(Text("SGLang and vLLM capture the same stream at every slot for this draft", "ok"))
    return out
