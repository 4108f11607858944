"""What an EAGLE-3 layer id really captures in SGLang 0.5.23, per architecture.

Pure Python (no sglang import): used by `tpprobe layers` and by the probe report.

The ids here are the ids a user hands SGLang, i.e. what `set_eagle3_layers_to_capture(ids)`
receives (a draft model's `eagle_aux_hidden_state_layer_ids`). tpprobe passes them to SGLang
verbatim; this module says what SGLang then does with them.

SGLang's rules (read in the 0.5.23 source; tests/unit/test_layer_ids.py pins each rule, and
tests/engines/sglang/test_sglang_models.py checks them against real captures of SGLang's tiny models vs HF):

* Decoder layer ``i`` in SGLang's ``layers_to_capture`` captures the residual stream *entering*
  layer ``i`` (previous layer's output after its all-reduce, plus residual; before the input norm)
  = HF ``hidden_states[i]``. ``i = 0`` is the embedding output. The loop runs ``i = 0..L-1``, so an
  index ``L`` (the final layer's output) or a negative one is never reached.
* Llama (models/llama.py ``set_eagle3_layers_to_capture``): ``layers_to_capture = [id + 1 ...]``
  always. So id -1 = embedding output, id k = HF hidden_states[k+1], id L-1 -> L is never reached:
  silently dropped when another id captures something (the draft gets fewer slots); alone it
  crashes (llama.py unpacks a missing aux list). Captures go in an ``AuxHiddenStateList``.
* DeepSeek-V2/V3/Kimi (models/deepseek_v2.py): ``+1`` ONLY when the first id is 1, otherwise the
  ids are used as given, so id k = HF hidden_states[k]. Captures go in an ``AuxHiddenStatePacker``
  sized for every requested id: any id that captures nothing (out of range, duplicate) crashes
  with ``captured n of K aux hidden states``.
* Both: ``i in layers_to_capture`` is a membership test, so slots come out in *layer order*,
  not in the requested order, and a duplicate captures once.
* ``ids=None`` means SGLang's default ``layers_to_capture = [2, L//2, L-3]`` (no +1 applied).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tpprobe.capture.points import EMBED_OUT, id_point, layer_out
from tpprobe.core.errors import UsageError

SGLANG_VERSION = "0.5.23"

# arch name (as given to --arch, or HF model_type) -> capture family
_FAMILIES = {
    "llama": "llama",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",
}
ARCHES = tuple(_FAMILIES)


def family(arch: str) -> str:
    try:
        return _FAMILIES[arch.lower()]
    except KeyError:
        raise UsageError(
            f"unknown SGLang arch {arch!r}: layer-id rules are known for {', '.join(ARCHES)}"
        ) from None


@dataclass
class LayerIdRow:
    requested: Optional[int]   # the id given (None for SGLang's default list)
    layer: int                 # index in SGLang's layers_to_capture
    captured: bool             # does the forward loop ever reach it
    slot: Optional[int]        # position in the packed aux tensor (None: no slot)
    hf_index: Optional[int]    # HF hidden_states index the slot equals (None: nothing)
    what: str                  # what it physically is
    status: str                # "ok" | "dropped" | "crash"
    note: str


@dataclass
class LayerPlan:
    arch: str
    family: str
    num_layers: int
    ids: Optional[list[int]]
    shift: int                           # +1 or 0 applied to every id
    rule: str                            # one line: which +1 rule applied and why
    layers_to_capture: list[int]
    rows: list[LayerIdRow] = field(default_factory=list)
    crash: Optional[str] = None          # what SGLang's forward raises, if it does
    outside: Optional[str] = None        # the rule lives outside SGLang's code (its setter hands the ids on)
    source: str = "pinned SGLang 0.5.23 table (sglang not installed)"
    sglang_class: str = ""

    @property
    def problems(self) -> list[str]:
        """Ids that crash, capture nothing or capture a stream another id already put in a slot (tpprobe layers
        exits 1 on any): each named as given, or as the model's default id when none were given, with the slot
        that holds a duplicate's stream."""
        defaults = [r.layer for r in self.rows]
        out = []
        for r in self.rows:
            if r.status not in ("crash", "dropped", "duplicate"):
                continue
            name = f"id {r.requested}" if r.requested is not None else \
                f"default id {r.layer} (ids not given: the model's default ids {defaults})"
            held = next((x.slot for x in self.rows if x.slot is not None and x.hf_index == r.hf_index), None) \
                if r.slot is None and r.hf_index is not None else None
            out.append(f"{name}: {r.status}" + (f", its stream captured once, in aux slot {held}"
                                                if held is not None else ""))
        return out + ([f"crash: {self.crash}"] if self.crash and not out else [])

    @property
    def slot_hf_indices(self) -> list[int]:
        """HF hidden_states index held by each slot of the packed aux tensor, in slot order."""
        return sorted({r.hf_index for r in self.rows if r.slot is not None})

    @property
    def num_slots(self) -> int:
        return len(self.slot_hf_indices)


def what_id_captures(layer: int, num_layers: int) -> str:
    """What HF hidden_states index `layer` holds, in words (the same stream on both engines)."""
    if layer == 0:
        return "embedding output (= HF hidden_states[0])"
    if layer == num_layers:
        return (f"residual stream leaving the last layer, before the final norm (HF "
                f"hidden_states[{layer}] is after it)")
    return f"residual stream entering layer {layer} = layer {layer - 1}'s output = HF hidden_states[{layer}]"


def point_of(layer: int, num_layers: int) -> str:
    """tpprobe's capture point for what SGLang captures at the entry of `layer` (one vocabulary: the
    report's rows are named so)."""
    if not 0 <= layer < num_layers:
        return "-"
    return id_point(layer - 1)       # the entry of layer L is layer L-1's output (-1: the embedding)


def plan_from_derived(arch: str, d) -> LayerPlan:
    """A LayerPlan from what SGLang's own setter did (tpprobe.engines.sglang.rules_replay.Derived)."""
    L = d.num_layers
    ids = d.ids
    ltc = list(d.layers_to_capture or [])
    requested: list[Optional[int]] = [None] * len(ltc) if ids is None else list(ids)
    if ids is not None and ltc == [i + 1 for i in ids]:
        shift, how = 1, "+1 applied to every id"
    elif ids is not None and ltc == list(ids):
        shift, how = 0, "ids used as given (no +1)"
    elif ids is None:
        shift, how = 0, "ids not given: the model's default"
    else:
        shift, how = 0, f"ids mapped to {ltc}"
    cond = ("the loop captures layers whose _is_layer_to_capture flag is set" if d.loop_uses_flags
            else "the loop captures layer i when i in layers_to_capture")
    extra = ("; point L (the last layer's output, pre-norm) is captured after the loop" if d.captures_last
             else "; point L is never reached")
    extra += ("; captures go into an AuxHiddenStatePacker sized for every id (a missing one raises)"
              if d.packer else "")
    rule = (f"{d.cls}.set_eagle3_layers_to_capture ({d.file}) -> layers_to_capture {ltc or d.flagged}: "
            f"{how}; {cond}{extra}")
    p = LayerPlan(arch=arch, family=d.cls, num_layers=L, ids=ids, shift=shift, rule=rule,
                  layers_to_capture=ltc, source=f"derived from the installed SGLang ({d.file})",
                  sglang_class=d.cls)
    if getattr(d, "outside", None):
        p.outside = d.outside
        p.rule = d.outside
        for req in requested:
            p.rows.append(LayerIdRow(req, -1, False, None, None, "not readable here", "unknown",
                                     "its rule is outside SGLang's code"))
        return p
    if d.set_error:
        p.crash = f"SGLang's setter raises at server start: {d.set_error}"
        for req, c in zip(requested, ltc or [None] * len(requested)):
            p.rows.append(LayerIdRow(req, c if c is not None else -1, False, None, None, "nothing",
                                     "crash", "set_eagle3_layers_to_capture raised"))
        return p
    captured = d.captured
    seen: set[int] = set()
    for req, c in zip(requested, ltc):
        note = f"+1 applied ({req}->{c})" if req is not None and c == req + 1 else (
            "no +1" if req is not None and c == req else "")
        point = c
        if d.loop_uses_flags and -L <= c < 0:
            point = c + L
            note += f"; negative id flags layer {point} through Python's negative index"
        if point not in captured:
            why = (f"layer {c} = output of the last layer: the loop (0..{L - 1}) never reaches it"
                   if c == L else f"layer {c} is outside 0..{L - 1}: never reached")
            p.rows.append(LayerIdRow(req, c, False, None, None, "nothing", "", f"{note}; {why}".strip("; ")))
        elif point in seen:
            p.rows.append(LayerIdRow(req, c, True, None, point, what_id_captures(point, L), "",
                                     f"{note}; duplicate of an earlier id: captured once".strip("; ")))
        else:
            seen.add(point)
            p.rows.append(LayerIdRow(req, c, True, captured.index(point), point, what_id_captures(point, L), "ok",
                                     note.strip("; ")))
    n_req = len(ltc)
    if d.packer:
        for r in p.rows:
            if r.status == "":
                r.status = "crash"
        if any(r.status == "crash" for r in p.rows) or len(captured) < n_req:
            for r in p.rows:
                if r.status == "" or (r.slot is None and r.status != "crash"):
                    r.status = "crash"
            p.crash = (f"AuxHiddenStatePacker expects {n_req} captures, gets {len(captured)}: "
                       f"RuntimeError 'captured {len(captured)} of {n_req} aux hidden states'")
    elif not captured:
        for r in p.rows:
            r.status = "crash"
        p.crash = ("no id captures anything: the forward returns no aux hidden states although "
                   f"EAGLE-3 capture is on ({d.forward_of} in {d.file.split(':')[0]} gets no aux list)")
    else:
        for r in p.rows:
            if r.status == "":
                r.status = "dropped" if r.hf_index is None else "duplicate"
    if captured and [r.hf_index for r in p.rows if r.slot is not None] != captured:
        for r in p.rows:
            if r.slot is not None:
                r.note = (r.note + "; " if r.note else "") + "slots follow layer order, not the order of the ids"
    return p


def plan(arch: str, ids: Optional[list[int]], num_layers: int) -> LayerPlan:
    """What SGLang does with `ids` on a model of `num_layers` layers of architecture `arch`.

    The rule is SGLang's own code: tabulated from SGLang 0.5.23 for every architecture with EAGLE-3
    capture (tpprobe/engines/sglang/rules_table.py, generated by tpprobe.engines.sglang.rules; no SGLang needed, and
    no SGLang import when 0.5.23 is the installed one), or, with another SGLang release installed,
    derived from that release's code (tpprobe.engines.sglang.rules runs the architecture's
    `set_eagle3_layers_to_capture` on a shell of the class and reads its capture condition)."""
    if int(num_layers) < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    from tpprobe.engines.sglang import rules_replay

    if rules_replay.use_table():
        p = plan_from_derived(arch, rules_replay.derive_from_table(arch, ids, num_layers))
        v = rules_replay.installed_version()
        p.source = (f"SGLang {SGLANG_VERSION}'s code, tabulated ({rules_replay.TABLE_MODULE}; "
                    + ("SGLang not installed" if v is None else f"the installed SGLang is {v}") + ")")
        return p
    from tpprobe.engines.sglang import rules

    return plan_from_derived(arch, rules.derive(arch, ids, num_layers))


def pinned_plan(arch: str, ids: Optional[list[int]], num_layers: int) -> LayerPlan:
    """Apply SGLang 0.5.23's capture-id rules for `arch` to `ids` on a model of `num_layers`
    (the pinned table: used only when SGLang is not installed)."""
    fam = family(arch)
    L = int(num_layers)
    if L < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    if ids is None:
        shift, rule = 0, "ids not given: SGLang's default layers_to_capture [2, L//2, L-3], no +1"
        layers = [2, L // 2, L - 3]
        requested: list[Optional[int]] = [None] * 3
    else:
        ids = [int(i) for i in ids]
        if fam == "llama":
            shift, rule = 1, "Llama: +1 always (layer i captures the output of layer i-1)"
        elif ids and ids[0] == 1:
            shift, rule = 1, "DeepSeek-V2/V3/Kimi: first id is 1, so +1 applies to every id"
        else:
            shift, rule = 0, "DeepSeek-V2/V3/Kimi: first id is not 1, so ids are used as given (no +1)"
        layers = [i + shift for i in ids]
        requested = list(ids)

    reached = [0 <= c < L for c in layers]
    slot_layers = sorted({c for c, ok in zip(layers, reached) if ok})
    n_captures_packer = sum(1 for c in set(layers) if 0 <= c < L)
    p = LayerPlan(arch=arch, family=fam, num_layers=L, ids=ids, shift=shift, rule=rule,
                  layers_to_capture=layers)
    seen: set[int] = set()
    for req, c, ok in zip(requested, layers, reached):
        shift_note = f"+1 applied ({req}->{c})" if shift and req is not None else "no +1"
        if not ok:
            if c == L:
                why = f"layer {c} = output of the last layer: the loop (0..{L - 1}) never reaches it"
            else:
                why = f"layer {c} is outside 0..{L - 1}: never reached"
            row = LayerIdRow(req, c, False, None, None, "nothing", "", f"{shift_note}; {why}")
        elif c in seen:
            row = LayerIdRow(req, c, True, None, c, what_id_captures(c, L), "",
                             f"{shift_note}; duplicate of an earlier id: captured once")
        else:
            seen.add(c)
            slot = slot_layers.index(c)
            row = LayerIdRow(req, c, True, slot, c, what_id_captures(c, L), "ok", shift_note)
        p.rows.append(row)

    captured_any = bool(slot_layers)
    if fam == "llama":
        for r in p.rows:
            if r.status == "":
                r.status = "dropped" if captured_any else "crash"
        if not captured_any:
            p.crash = ("no id captures anything: LlamaForCausalLM.forward unpacks a missing aux "
                       "list (llama.py:621) and fails")
    else:
        bad = [r for r in p.rows if r.status == ""]
        for r in bad:
            r.status = "crash"
        if bad and captured_any:
            p.crash = (f"AuxHiddenStatePacker expects {len(layers)} captures, gets "
                       f"{n_captures_packer}: RuntimeError 'captured {n_captures_packer} of "
                       f"{len(layers)} aux hidden states'")
        elif bad:
            p.crash = ("no id captures anything: the model returns no aux hidden states although "
                       "EAGLE-3 capture is on")
    if captured_any and [r.layer for r in p.rows if r.slot is not None] != slot_layers:
        for r in p.rows:
            if r.slot is not None:
                r.note += "; slots follow layer order, not the order of the ids"
    return p


def parse_ids(text: Optional[str]) -> Optional[list[int]]:
    """'-1,2,30' -> [-1, 2, 30]; None (no --ids) -> None (the default). Bad text, an empty one too -> UsageError."""
    if text is None:
        return None
    if not text.strip():
        raise UsageError(f"--ids {text!r} is empty: give comma-separated layer ids like -1,2,30, or leave --ids out "
                         f"for the default")
    parts = [x.strip() for x in text.split(",")]
    if "" in parts:
        raise UsageError(f"--ids {text!r} has an empty entry: give comma-separated integers like -1,2,30")
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise UsageError(f"--ids must be comma-separated integers like -1,2,30, got {text!r}") from None


def layer_point(layer: int) -> str:
    """tpprobe's capture point equal to the stream SGLang captures at `layers_to_capture` entry
    `layer` (the stream entering that layer): embed.out for 0, else layer.{layer-1}.out."""
    return EMBED_OUT if layer == 0 else layer_out(layer - 1)


def expected_slots(p: LayerPlan) -> tuple[list[Optional[str]], list[Optional[int]]]:
    """(points, ids): for each slot of the packed aux tensor, in slot order, the capture point it
    must equal and the id that asked for it; then one `None` point per id that captures nothing
    (dropped), so the slot check names it as missing. The checks use these instead of the
    SGLang-Llama convention (id k -> layer.k.out), which is wrong for DeepSeek (no +1)."""
    points: list[Optional[str]] = []
    ids: list[Optional[int]] = []
    for r in sorted((r for r in p.rows if r.slot is not None), key=lambda r: r.slot):
        points.append(layer_point(r.layer))
        ids.append(r.requested)
    for r in p.rows:
        if r.status == "dropped":
            points.append(None)
            ids.append(r.requested)
    return points, ids


def slots_from_layers_to_capture(layers_to_capture, num_layers: int
                                  ) -> tuple[list[Optional[str]], list[int]]:
    """(points, ids) like `expected_slots`, from a live model's `layers_to_capture` (what the
    plugin sees: the ids' +1 is already applied). ids are in tpprobe's convention (layer c -> id
    c-1, -1 = embedding); entries the loop never reaches come last with point None."""
    ltc = sorted({int(c) for c in layers_to_capture})
    inside = [c for c in ltc if 0 <= c < num_layers]
    outside = [c for c in ltc if not 0 <= c < num_layers]
    return ([layer_point(c) for c in inside] + [None] * len(outside),
            [c - 1 for c in inside] + [c - 1 for c in outside])


def all_rows(ids: Optional[list[int]], num_layers: int) -> list[dict]:
    """One row per SGLang architecture: what its rule captures for `ids` (`tpprobe layers --arch all`)."""
    from tpprobe.engines.sglang import rules, rules_replay

    if rules_replay.use_table():     # SGLang 0.5.23's rules as data: no SGLang needed, none imported
        pairs = [(f, name, rules_replay.derive_from_table(key, ids, num_layers))
                 for f, name, key in rules_replay.table_rows()]
    else:                            # another SGLang release installed: its own code
        pairs = [(f, cls.__name__, rules.derive(cls, ids, num_layers)) for f, cls in rules.all_architectures()]
    out = []
    for f, name, d in pairs:
        p = plan_from_derived(name, d)
        out.append({"arch": name, "file": f, "rule": p.rule, "layers_to_capture": p.layers_to_capture,
                    "slots": p.slot_hf_indices, "problems": p.problems, "crash": p.crash, "outside": p.outside})
    return out
