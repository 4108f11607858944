"""What an engine captures for a list of EAGLE-3 ids: the one function every reader of an engine's
capture rule goes through (`tpprobe layers`, the contract view, `tpprobe fix`, the plugins' slot
expectations), with a user's own build described on top of the stock rule.

    plan_for(engine, arch, ids, num_layers, id_rule=None) -> LayerPlan

`engine` is "sglang" (tpprobe.engines.sglang.layer_ids.plan: SGLang's +1 rules) or "vllm"
(tpprobe.engines.vllm.layer_ids.plan: ids as written). `id_rule` describes a patched engine: for
the ids it names, what that build captures instead of the stock rule, e.g. the seed's SGLang
patched so that id -1 is the embedding output. Its text form (the CLI's `--id-rule`, the plugins'
`TPPROBE_ID_RULE` environment variable) is a comma-separated list of `ID=WHAT`:

    -1=embed          id -1 captures the embedding output          (HF hidden_states[0])
    5=out:4           id 5 captures layer 4's output               (HF hidden_states[5])
    7=in:7            id 7 captures the stream entering layer 7    (HF hidden_states[7])
    9=hs:12           id 9 captures HF hidden_states[12]

Every other id keeps the stock rule of the engine, computed on the whole list (so SGLang's DeepSeek
"+1 only when the first id is 1" still looks at the list as written). The named ids always capture
(the build was patched to make them), slots still come out in ascending layer order (both engines
append during the forward loop), and a crash the stock rule reports only because a named id
captured nothing is gone.
"""
from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Optional

from tpprobe.core.errors import UsageError

ENGINES = ("sglang", "vllm")
ENV = "TPPROBE_ID_RULE"
_WHAT = re.compile(r"^(embed|embedding|out:(-?\d+)|in:(\d+)|hs:(\d+))$")


def parse_id_rule(text: Optional[str], where: str = "--id-rule") -> dict[int, int]:
    """'-1=embed,5=out:4' -> {id: HF hidden_states index}; '' or None -> {}. Bad text -> UsageError."""
    out: dict[int, int] = {}
    if text is None or not str(text).strip():
        return out
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise UsageError(f"{where} {text!r}: an empty entry; write ID=WHAT entries separated by commas, "
                             f"e.g. -1=embed")
        left, eq, right = part.partition("=")
        m = _WHAT.match(right.strip().lower())
        try:
            i = int(left.strip())
        except ValueError:
            i = None
        if not eq or i is None or m is None:
            raise UsageError(f"{where} {part!r}: write ID=WHAT with WHAT one of embed, out:K (layer K's output), "
                             f"in:K (the stream entering layer K), hs:N (HF hidden_states[N]); e.g. -1=embed")
        if m.group(2) is not None:
            hf = int(m.group(2)) + 1
        elif m.group(3) is not None:
            hf = int(m.group(3))
        elif m.group(4) is not None:
            hf = int(m.group(4))
        else:
            hf = 0
        if hf < 0:
            raise UsageError(f"{where} {part!r}: out:{hf - 1} names no layer (out:-1 is the embedding: write embed)")
        if i in out and out[i] != hf:
            raise UsageError(f"{where} {text!r}: id {i} is given twice with different captures")
        out[i] = hf
    return out


def env_id_rule() -> dict[int, int]:
    """The rule in TPPROBE_ID_RULE (the plugins' way to describe a patched build); a bad value raises
    UsageError naming the variable."""
    return parse_id_rule(os.environ.get(ENV), ENV)


def rule_text(rule: dict[int, int]) -> str:
    """{-1: 0} -> '-1=embed' (the canonical text form)."""
    return ",".join(f"{i}=embed" if hf == 0 else f"{i}=hs:{hf}" for i, hf in sorted(rule.items()))


def describe_rule(rule: dict[int, int], num_layers: int) -> str:
    from tpprobe.engines.sglang.layer_ids import what_id_captures
    return "; ".join(f"id {i} = {what_id_captures(hf, num_layers)}" for i, hf in sorted(rule.items()))


def stock_plan(engine: str, arch: str, ids: Optional[list[int]], num_layers: int):
    if engine == "sglang":
        from tpprobe.engines.sglang.layer_ids import plan
        return plan(arch, ids, num_layers)
    if engine == "vllm":
        from tpprobe.engines.vllm.layer_ids import plan
        return plan(arch, ids, num_layers)
    raise UsageError(f"--engine {engine!r}: use sglang or vllm")


def plan_for(engine: str, arch: str, ids: Optional[list[int]], num_layers: int,
             id_rule: Optional[dict[int, int]] = None):
    """What `engine` captures for `ids` on a model of `arch` with `num_layers` layers, with the ids in
    `id_rule` captured as that rule says (a patched build). A tpprobe LayerPlan."""
    p = stock_plan(engine, arch, ids, num_layers)
    if not id_rule or ids is None or not any(i in id_rule for i in ids):
        return p
    return apply_id_rule(p, id_rule)


def apply_id_rule(p, rule: dict[int, int]):
    """The stock plan `p` with the ids of `rule` captured as the rule says."""
    from tpprobe.engines.sglang.layer_ids import LayerIdRow, what_id_captures

    L = p.num_layers
    for i, hf in rule.items():
        if not 0 <= hf <= L:
            raise UsageError(f"--id-rule {i}={rule_text({i: hf}).split('=')[1]}: HF hidden_states[{hf}] does not "
                             f"exist on a model of {L} layers (0..{L})")
    rows = []
    for r in p.rows:
        if r.requested in rule:
            hf = rule[r.requested]
            rows.append(LayerIdRow(r.requested, r.layer, True, None, hf, what_id_captures(hf, L), "ok",
                                   f"your build's rule (--id-rule / {ENV}): id {r.requested} = HF "
                                   f"hidden_states[{hf}]"))
        else:
            rows.append(replace(r, slot=None))
    held = sorted({r.hf_index for r in rows if r.captured and r.hf_index is not None})
    seen: set[int] = set()
    for r in rows:
        if not r.captured or r.hf_index is None:
            continue
        if r.hf_index in seen:
            r.slot, r.status = None, "duplicate"
            continue
        seen.add(r.hf_index)
        r.slot, r.status = held.index(r.hf_index), "ok"
    missing = [r for r in rows if not r.captured or r.hf_index is None]
    crash = p.crash
    if crash and not missing:
        crash = None
    q = replace(p, rows=rows, crash=crash,
                rule=p.rule + f"; your build: {describe_rule({i: rule[i] for i in rule if i in (p.ids or [])}, L)}")
    return q
