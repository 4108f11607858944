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

Also here: `EngineRule` (the rule as an object: ids -> the HF index in each slot, and the engine
function a code change would patch), `ids_for` (the rule inverted), `ids_to_write` (the ids to write
for a draft, or why none do), `expected_slots` / `sglang_live_slots` / `vllm_knob_slots` (the
plugins' slot expectations through the same rule).

Every other id keeps the stock rule of the engine, computed on the whole list (so SGLang's DeepSeek
"+1 only when the first id is 1" still looks at the list as written). The named ids always capture
(the build was patched to make them), slots still come out in ascending layer order (both engines
append during the forward loop), and a crash the stock rule reports only because a named id
captured nothing is gone.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
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
    from ..config.knobs import knob
    return parse_id_rule(knob(ENV), ENV)


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
             id_rule: Optional[dict[int, int]] = None, strict: bool = True):
    """What `engine` captures for `ids` on a model of `arch` with `num_layers` layers, with the ids in
    `id_rule` captured as that rule says (a patched build). A tpprobe LayerPlan. An architecture whose rule
    is outside the engine's code, with ids the id rule does not cover: UsageError, or (strict=False, a search
    over ids) the plan with those rows `unknown`."""
    p = stock_plan(engine, arch, ids, num_layers)
    if id_rule and ids is not None and any(i in id_rule for i in ids):
        p = apply_id_rule(p, id_rule)
    if strict and unknown(p):
        # not a finding about these ids: nothing here can say what they capture
        raise UsageError(f"{p.outside}; give your build's rule for every id with --id-rule (or {ENV}), "
                         f"or probe the running server (tpprobe's SGLang plugin)")
    return p


def unknown(p) -> bool:
    """Does the plan hold an id whose capture no rule here gives (an engine rule outside the engine's code)?"""
    return bool(getattr(p, "outside", None)) and (p.ids is None or any(r.status == "unknown" for r in p.rows))


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


# ---- the rule as an object, and inverted: which ids give a list of streams ---------------------------
@dataclass
class EngineRule:
    """An engine's capture rule for one target: ids -> the streams in each slot (slot order)."""
    engine: str                   # sglang | vllm
    arch: str
    num_layers: int
    id_rule: dict = field(default_factory=dict)      # a patched build: id -> HF index (engines.capture_rule)
    _seen: dict = field(default_factory=dict, repr=False, compare=False)   # ids -> slots, this rule's answers

    def plan(self, ids, strict: bool = False):
        return plan_for(self.engine, self.arch, list(ids), self.num_layers, self.id_rule or None, strict=strict)

    def slots(self, ids) -> Optional[list[int]]:
        """The HF index in each slot, or None when the engine crashes or drops an id with these ids, or
        when no rule here says what one of them captures."""
        key = tuple(ids)
        if key not in self._seen:
            p = self.plan(ids)
            self._seen[key] = None if p.crash or p.problems or unknown(p) else [
                r.hf_index for r in sorted((r for r in p.rows if r.slot is not None), key=lambda r: r.slot)]
        return None if self._seen[key] is None else list(self._seen[key])

    def name(self) -> str:
        return f"{'SGLang' if self.engine == 'sglang' else 'vLLM'} {self.arch}" + (
            f" (patched: {rule_text(self.id_rule)})" if self.id_rule else "")

    def patch_point(self) -> str:
        """The engine function that decides what an id captures (what a code change would patch)."""
        p = self.plan([2])
        if self.engine == "sglang":
            return (f"{p.sglang_class}.set_eagle3_layers_to_capture and the decoder loop it feeds "
                    f"({p.rule.split('(')[1].split(')')[0] if '(' in p.rule else 'SGLang'})")
        from tpprobe.engines.vllm import layer_ids as v
        r = v.rule_of(self.arch)
        if r["kind"] == "hf-recorder":
            return f"{r['cls']}.set_aux_hidden_state_layers ({r['setter_at']})"
        return f"{r['holder']}.forward ({r['capture_at']}), which offers the loop points to the aux capture"


def ids_for(rule: EngineRule, hfs: list[int], prefer: Optional[list[int]] = None, any_order: bool = True
            ) -> Optional[list[int]]:
    """Ids that make `rule`'s engine put exactly `hfs` in its slots (in that order), preferring ids in
    layer order and the fewest changed from `prefer`; None when no id list does. Ids out of layer order
    are tried last: a rule may read the list's order (SGLang's DeepSeek adds 1 to every id only when the
    first is 1) although the slots come out in layer order either way."""
    L = rule.num_layers
    opts = []
    for h in hfs:
        o = {h - 2, h - 1, h, h + 1} | {i for i, v in rule.id_rule.items() if v == h}
        opts.append(sorted(i for i in o if -2 <= i <= L + 1))
    found = _search(rule, hfs, opts, prefer, False)
    if found is None and any_order and len(hfs) <= 4:
        found = _search(rule, hfs, opts, prefer, True)
    return found


def _search(rule: EngineRule, hfs, opts, prefer, permute: bool) -> Optional[list[int]]:
    best, best_cost = None, None
    for base in itertools.product(*opts):
        if len(set(base)) != len(base):
            continue
        for ids in (itertools.permutations(base) if permute else (base,)):
            cost = sum(1 for a, b in zip(ids, prefer or []) if a != b) if prefer and len(prefer) == len(ids) else 0
            cost += 0 if list(ids) == sorted(ids) else 10       # ids in layer order: what the engine does anyway
            if best_cost is not None and cost >= best_cost:
                continue
            if rule.slots(list(ids)) == list(hfs):
                best, best_cost = list(ids), cost
    return best


def config_field(engine: str) -> str:
    """The draft config's field the engine reads its ids from: SGLang the nested eagle_config's first."""
    return ("eagle_config." if engine == "sglang" else "") + "eagle_aux_hidden_state_layer_ids"


def unreachable(rule: EngineRule, hfs: list[int]) -> list[str]:
    """Why no id list gives `hfs` (one line per stream no single id reaches), naming what to patch."""
    L = rule.num_layers
    out = []
    for h in hfs:
        if any(rule.slots([i]) == [h] for i in range(-2, L + 2)) or any(v == h for v in rule.id_rule.values()):
            continue
        what = ("the embedding" if h == 0 else f"the last layer's output (HF hidden_states[{L}])" if h == L
                else f"HF hidden_states[{h}]")
        if any(unknown(rule.plan([i])) for i in range(max(-2, h - 2), min(L + 1, h + 1) + 1)):
            # not "no id gives it": what these ids capture is decided outside the engine's code
            out.append(f"which id gives {what} is not known here: {rule.name()} hands the ids to code outside "
                       f"{'SGLang' if rule.engine == 'sglang' else 'vLLM'}; give your build's rule for it with "
                       f"--id-rule")
            continue
        out.append(f"no id list gives {what} on this engine: patch {rule.patch_point()}")
    return out


# ---- the plugins' slot expectations: the same rule, from what a live model holds ----------------------
def expected_slots(p) -> tuple[list, list]:
    """(points, ids) for each slot of the packed aux, in slot order: the capture point it must equal and
    the id that asked for it; then one None point per id that captures nothing (so the slot check names
    it as missing). From a plan of `plan_for` (stock or with a build's id rule)."""
    from tpprobe.engines.sglang.layer_ids import layer_point
    held = sorted((r for r in p.rows if r.slot is not None), key=lambda r: r.slot)
    points: list = [layer_point(r.hf_index) for r in held]
    ids: list = [r.requested for r in held]
    for r in p.rows:
        if r.status in ("dropped", "crash") and r.slot is None and not r.captured:
            points.append(None)
            ids.append(r.requested)
    return points, ids


def sglang_live_slots(model_class: str, layers_to_capture, num_layers: int, rule: Optional[dict] = None):
    """The SGLang plugin's slot expectations from a live model's `layers_to_capture`: the stock reading
    (tpprobe.engines.sglang.layer_ids.slots_from_layers_to_capture) unless a build's id rule is given
    (default: TPPROBE_ID_RULE); then the ids are recovered by running the architecture's own setter rule
    backwards (ids = layers_to_capture, or each minus the +1) and the rule applied through `plan_for`.
    Returns ((points, ids), note); a bad rule or an architecture the rules do not know keeps the stock
    reading and says why in `note` (a plugin never stops the engine)."""
    from tpprobe.engines.sglang.layer_ids import slots_from_layers_to_capture
    stock = slots_from_layers_to_capture(layers_to_capture, num_layers)
    try:
        rule = env_id_rule() if rule is None else rule
    except UsageError as e:
        return stock, f"{e}: the stock rule is used"
    if not rule:
        return stock, ""
    ltc = [int(c) for c in layers_to_capture]
    for ids in (ltc, [c - 1 for c in ltc]):
        try:
            p = stock_plan("sglang", model_class, ids, num_layers)
        except UsageError as e:
            return stock, f"{ENV} not applied: {e}"
        if list(p.layers_to_capture) == ltc:
            return expected_slots(plan_for("sglang", model_class, ids, num_layers, rule)), \
                f"your build ({ENV}={rule_text(rule)}): {describe_rule(rule, num_layers)}"
    return stock, f"{ENV} not applied: no ids give layers_to_capture {ltc} under {model_class}'s rule"


def vllm_knob_slots(layer_ids: list[int], rule: Optional[dict] = None):
    """The vLLM worker's slot expectations for its aux knob (tpprobe ids i, vLLM ids i + 1), through the
    same rule: the stock reading (ascending id, a duplicate once) unless a build's rule (default:
    TPPROBE_ID_RULE, keyed by vLLM's ids) names some ids. Returns ((points, ids), note)."""
    from tpprobe.capture.points import id_point
    from tpprobe.engines.sglang.layer_ids import layer_point
    try:
        rule = env_id_rule() if rule is None else rule
    except UsageError as e:
        rule, note = {}, f"{e}: the stock rule is used"
    else:
        note = ""
    ids = sorted(set(int(i) for i in layer_ids))
    if not rule or not any(i + 1 in rule for i in ids):
        return ([id_point(i) for i in ids], ids), note
    held = sorted(((rule.get(i + 1, i + 1), i) for i in ids))
    return ([layer_point(hf) for hf, _ in held], [i for _, i in held]), \
        f"your build ({ENV}={rule_text(rule)}), keyed by vLLM's ids"


def ids_to_write(engine: str, arch: str, L: int, want: list[int], draft_ids: Optional[list[int]] = None,
                 id_rule: Optional[dict] = None) -> Optional[dict]:
    """The ids to write so that `engine` puts HF hidden_states `want` (what the draft was trained on, slot
    by slot) in its slots, preferring the fewest changed from `draft_ids`: {"ids", "field", "line"}, with
    ids None and the line saying why no id list does and what to patch. None when `want` names a stream
    the model does not have. `tpprobe layers` shows it beside the contract."""
    if not want or not all(0 <= w <= L for w in want):
        return None
    rule = EngineRule(engine, arch, L, dict(id_rule or {}))
    key = config_field(engine)
    who = ("SGLang" if engine == "sglang" else "vLLM") + (" (your build)" if id_rule else "")
    ids = ids_for(rule, want, draft_ids)
    if ids is not None:
        alt = rule.slots(sorted(ids))
        why = "" if ids == sorted(ids) else (
            f" (in this order on purpose: {sorted(ids)} would give "
            f"{'HF hidden_states' + str(alt) if alt else 'a crash or a dropped id'}, since the rule reads the "
            f"list's order; the slots come out in layer order either way)")
        return {"ids": ids, "field": key,
                "line": f"write {key} = {ids} for this draft on {who}: it then captures HF hidden_states{want}, "
                        f"what the draft expects{why}"}
    why = [w.replace(" on this engine:", f" on {who}:") for w in unreachable(rule, want)]   # beside the other engine's
    if sorted(want) != want:
        why.insert(0, f"the draft expects its slots in the order HF hidden_states{want}, and {who} fills them in "
                      f"ascending layer order: permute the draft's fc.weight column blocks to layer order")
    if not why:
        why = [f"no id list gives HF hidden_states{want} on {who}: patch {rule.patch_point()}"]
    return {"ids": None, "field": key, "line": "; ".join(why)}
