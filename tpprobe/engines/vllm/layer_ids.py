"""What an EAGLE-3 layer id captures on vLLM, per architecture: the rule read from vLLM's own code.

Pure Python (no vllm import): used by `tpprobe layers --engine vllm` and by the cross-engine check
(tpprobe.engines.ids_compare). The rule of each architecture is vLLM 0.32.0's, tabulated from its code
(tpprobe/engines/vllm/rules_table.py, written by `python -m tpprobe.engines.vllm.rules --write`); with
another vLLM installed, tpprobe.engines.vllm.rules derives it from that vLLM's code.

vLLM's rule (the installed code says so; tests/engines/vllm/test_vllm_layers.py checks the table against it):

* The ids are used as written: `set_aux_hidden_state_layers(ids)` stores them (the interface stores
  them sorted and deduplicated, PR #50514; a few models as given), and the decoder's forward offers
  each loop point to `_maybe_add_hidden_state` (or tests `idx in aux_hidden_state_layers`): point 0
  before the loop (the embedding output), point i+1 after layer i, and for some models point N after
  the loop. Point k is the residual stream entering layer k = HF `hidden_states[k]`; point N is the
  last layer's output before the final norm. A membership test: slots come out in ascending id
  order, a duplicate captures once, a negative id or one past N captures nothing (silently).
* The draft's config is read by the model runner: the V1 runner (vLLM on CPU; `_get_eagle3_aux_
  layers_from_config`) takes the top-level `eagle_aux_hidden_state_layer_ids`, else DFlash's
  `target_layer_ids` + 1, and a nested `eagle_config.eagle_aux_hidden_state_layer_ids` overrides the
  DFlash ids; Model Runner V2 (the GPU default) takes the top-level ids, DFlash / DSpark ids + 1
  (DSpark `deepseek_v41` as written), `target_layer_ids` + 1, or `eagle_config.layer_ids`: it never
  reads `eagle_config.eagle_aux_hidden_state_layer_ids`. No ids: the model's default (2, N//2, N-3).
"""
from __future__ import annotations

from typing import Optional

from tpprobe.core.errors import UsageError
from tpprobe.engines.sglang.layer_ids import LayerIdRow, LayerPlan, what_id_captures

RUNNERS = ("v1", "v2")


# ---- the draft config -> the ids vLLM hands set_aux_hidden_state_layers --------------------------
def config_ids(draft: dict, runner: str = "v1") -> tuple[Optional[list[int]], str]:
    """(ids, where they came from) as vLLM 0.32.0's model runner reads a draft's config (None: the
    model's default). A replay of `GPUModelRunner._get_eagle3_aux_layers_from_config` (runner v1)
    and `eagle3_utils.get_eagle3_aux_layers_from_config` (runner v2); the vLLM tier checks both
    against vLLM's own functions."""
    if runner not in RUNNERS:
        raise UsageError(f"--vllm-runner {runner!r}: use v1 or v2")
    ids, where = draft.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if runner == "v1":
        if not ids:
            dflash, eagle = draft.get("dflash_config"), draft.get("eagle_config")
            if dflash and isinstance(dflash, dict):
                ids = [i + 1 for i in (dflash.get("target_layer_ids") or [])]
                where = "dflash_config.target_layer_ids + 1"
            if eagle and isinstance(eagle, dict):
                ids, where = eagle.get("eagle_aux_hidden_state_layer_ids"), \
                    "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        if not ids:
            dflash = draft.get("dflash_config")
            if dflash and isinstance(dflash, dict):
                ids = [i + 1 for i in (dflash.get("target_layer_ids") or [])]
                where = "dflash_config.target_layer_ids + 1"
        if not ids:
            ds = draft.get("dspark_target_layer_ids")
            if ds:
                if draft.get("model_type") == "deepseek_v41":
                    ids, where = list(ds), "dspark_target_layer_ids (deepseek_v41: as written)"
                else:
                    ids, where = [i + 1 for i in ds], "dspark_target_layer_ids + 1"
        if not ids:
            t = draft.get("target_layer_ids")
            if t:
                ids, where = [i + 1 for i in t], "target_layer_ids + 1"
        if not ids:
            for name in ("dflash_config", "eagle_config"):
                c = draft.get(name)
                if c and isinstance(c, dict):
                    ids = c.get("layer_ids")
                    if ids:
                        where = f"{name}.layer_ids"
                        break
    if ids and isinstance(ids, (list, tuple)):
        return list(ids), where
    return None, "no ids the runner reads: the model's default (2, N//2, N-3)"


# ---- the architecture's rule ------------------------------------------------------------------------
_LIVE: dict = {}     # process-wide by nature: the installed vLLM's rules, read once (its files do not change)


def use_table() -> bool:
    """The pinned table answers unless a vLLM of another release is installed (then its own code does)."""
    from tpprobe.engines.vllm import installed_version, rules_table

    v = installed_version()
    return v is None or v == rules_table.VLLM_VERSION


def _table() -> dict:
    if not use_table():          # another vLLM: derived from its code (imports its model files, once)
        if not _LIVE:
            from tpprobe.engines.vllm import rules

            _LIVE.update(rules.tabulate())
        return _LIVE
    from tpprobe.engines.vllm import rules_table as t

    return {"VLLM_VERSION": t.VLLM_VERSION, "CLASSES": t.CLASSES, "ALIASES": t.ALIASES,
            "NOT_READ": t.NOT_READ}


def version() -> str:
    """The vLLM release whose rules answer (the pinned table's, or the installed one's)."""
    return _table()["VLLM_VERSION"]


# wrappers whose EAGLE-3 setter hands the ids to their text model, read in vLLM 0.32.0's code
# (kimi_k25.py: set_aux_hidden_state_layers -> self.language_model, a DeepseekV3ForCausalLM)
DELEGATES = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


def resolve(name: str, tab: Optional[dict] = None) -> str:
    """An architecture name (the class in config.json's `architectures`, vLLM's model file, or a HF
    model_type) -> the table's key (a wrapper that hands its ids to its text model: the text model's).
    UsageError when vLLM has no EAGLE-3 capture for it."""
    tab = tab or _table()
    raw = name.strip()
    if raw in tab["CLASSES"]:
        return raw
    if raw in DELEGATES and DELEGATES[raw] in tab["CLASSES"]:
        return DELEGATES[raw]
    low = raw.lower().replace("-", "_")
    if low in tab["ALIASES"]:
        return tab["ALIASES"][low]
    for k in tab["CLASSES"]:
        if k.lower() == low:
            return k
    hint = (f"; vLLM {tab['VLLM_VERSION']} names it but its model file was not read here "
            f"({tab['NOT_READ'][raw]})" if raw in tab["NOT_READ"] else "")
    raise UsageError(f"unknown vLLM arch {name!r}: give an architecture from config.json (e.g. "
                     f"Qwen3MoeForCausalLM), a vLLM model file or a model_type; vLLM {tab['VLLM_VERSION']} has "
                     f"EAGLE-3 capture in {len(tab['CLASSES'])} architectures (`tpprobe layers --engine vllm "
                     f"--arch all` lists them){hint}")


def rule_of(arch: str) -> dict:
    """The tabulated (or derived) capture rule of one architecture (UsageError when vLLM has none)."""
    tab = _table()
    return tab["CLASSES"][resolve(arch, tab)]


def offered_points(rule: dict, N: int) -> list[int]:
    """The loop points (0..N) the forward offers to the capture."""
    pts: set[int] = set()
    for o in rule["offers"]:
        if o == "start":
            pts.add(0)
        elif o == "after_layer":
            pts.update(range(1, N + 1))
        elif o == "before_layer":
            pts.update(range(0, N))
        elif o == "end":
            pts.add(N)
    return sorted(pts)


def default_ids(rule: dict, N: int) -> list[int]:
    if rule["default"] == "2,N//2,N-3":
        return [2, N // 2, N - 3]
    raise UsageError(f"{rule['cls']}: vLLM's default aux layers are {rule['default']!r}; give --ids")


def rule_line(rule: dict) -> str:
    if rule["kind"] == "hf-recorder":
        return (f"{rule['cls']}.set_aux_hidden_state_layers ({rule['setter_at']}): an output recorder on HF layer "
                f"id-1 (`self._layer_names[layer - 1]`): id k = layer k-1's output = HF hidden_states[k]; "
                f"Python's negative index wraps (id 0 = the last layer's output)")
    offers = {"start": "0 before the loop", "after_layer": "i+1 after layer i", "before_layer": "i before layer i",
              "end": "N after the loop"}
    value = {"h+r": "hidden + residual", "h": "hidden only, WITHOUT the residual",
             "h (no residual)": "hidden (the model keeps no separate residual)"}[rule["value"]]
    return (f"ids as written (vLLM's rule); {rule['setter']}; {rule['holder']}.forward ({rule['capture_at']}) offers "
            f"points {', '.join(offers[o] for o in rule['offers'])} to a membership test: slots in ascending "
            f"id, a duplicate once, an id outside the offered points dropped; each capture is {value}")


# loop holders that offer point 0 but cannot capture it: they start the loop with `residual = None` and capture
# `hidden_states + residual` inline, so an id 0 raises TypeError at the first forward (vLLM 0.32's
# DeepseekV2Model.forward: DeepSeek-V2/V3, Kimi-K2; run in tests/engines/vllm/test_vllm_probe.py::
# test_deepseek_embedding_id_is_refused_in_one_line)
NONE_RESIDUAL_AT_0 = ("DeepseekV2Model",)


def plan(arch: str, ids: Optional[list[int]], num_layers: int, tab: Optional[dict] = None) -> LayerPlan:
    """What vLLM does with `ids` on a model of `num_layers` layers of architecture `arch`."""
    N = int(num_layers)
    if N < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    tab = tab or _table()
    key = resolve(arch, tab)
    rule = tab["CLASSES"][key]
    given = None if ids is None else [int(i) for i in ids]
    asked = default_ids(rule, N) if given is None else given
    from tpprobe.engines.vllm import installed_version

    v = installed_version()
    source = (f"derived from the installed vLLM {v}'s code" if not use_table() else
              f"vLLM {tab['VLLM_VERSION']}'s code, tabulated (tpprobe/engines/vllm/rules_table.py; "
              + ("vLLM not installed" if v is None else f"the installed vLLM is {v}") + ")")
    held = sorted(set(asked)) if rule["setter_sorts"] else list(asked)
    p = LayerPlan(arch=arch, family=rule["cls"], num_layers=N, ids=given, shift=0, rule=rule_line(rule),
                  layers_to_capture=held, source=source, sglang_class=rule["cls"])
    requested: list[Optional[int]] = [None] * len(asked) if given is None else list(given)
    if rule["kind"] == "hf-recorder":
        return _plan_recorder(p, rule, requested, asked, N)
    offered = set(offered_points(rule, N))
    none_at_0 = rule.get("holder") in NONE_RESIDUAL_AT_0 and rule["value"] == "h+r" and 0 in offered
    captured = sorted({k for k in asked if k in offered and not (none_at_0 and k == 0)})
    seen: set[int] = set()
    for req, k in zip(requested, asked):
        if none_at_0 and k == 0:
            p.crash = (f"{rule['holder']}.forward ({rule['capture_at']}) captures hidden_states + residual before "
                       f"layer 0, where its residual is still None: TypeError at the first forward")
            p.rows.append(LayerIdRow(req, k, False, None, None, "nothing", "crash",
                                     "the residual is None before layer 0: the forward raises"))
        elif k not in offered:
            why = ("negative: vLLM uses ids as written and no loop point is negative" if k < 0 else
                   f"past the last point {N}" if k > N else f"point {k} is never offered by this model's loop")
            p.rows.append(LayerIdRow(req, k, False, None, None, "nothing", "dropped",
                                     f"{why}; vLLM returns fewer aux states than ids"))
        elif k in seen:
            p.rows.append(LayerIdRow(req, k, True, None, k, what_id_captures(k, N), "duplicate",
                                     "duplicate of an earlier id: captured once"))
        else:
            seen.add(k)
            note = "" if rule["value"] != "h" else "captured WITHOUT the residual (hidden only)"
            p.rows.append(LayerIdRow(req, k, True, captured.index(k), k, what_id_captures(k, N), "ok", note))
    if captured and [r.hf_index for r in p.rows if r.slot is not None] != captured:
        for r in p.rows:
            if r.slot is not None:
                r.note = (r.note + "; " if r.note else "") + "slots follow id order ascending, not the order given"
    if not captured and not p.crash:
        p.crash = ("no id captures anything: the forward returns no aux hidden states although EAGLE-3 is on "
                   "(the proposer's torch.cat of an empty list fails)")
    return p


def _plan_recorder(p: LayerPlan, rule: dict, requested, asked, N: int) -> LayerPlan:
    seen: set[int] = set()
    slot = 0
    for req, k in zip(requested, asked):
        if not -N <= k - 1 < N:
            p.crash = f"set_aux_hidden_state_layers raises at load: IndexError (self._layer_names[{k - 1}])"
            p.rows.append(LayerIdRow(req, k, False, None, None, "nothing", "crash", "layer_names index out of range"))
            continue
        hf = (k - 1) % N + 1
        note = "" if hf == k else f"id {k}: Python's negative index: layer {hf - 1}'s output"
        if hf in seen:
            p.rows.append(LayerIdRow(req, k, True, None, hf, what_id_captures(hf, N), "duplicate", "captured once"))
            continue
        seen.add(hf)
        p.rows.append(LayerIdRow(req, k, True, slot, hf, what_id_captures(hf, N), "ok", note))
        slot += 1
    for r in p.rows:
        if r.status == "ok":
            r.note = (r.note + "; " if r.note else "") + "slot order: the recorders' order (read, not run)"
    return p


def all_rows(ids: Optional[list[int]], num_layers: int) -> list[dict]:
    """One entry per vLLM architecture (the `--arch all` view)."""
    tab = _table()
    out = []
    for key, rule in tab["CLASSES"].items():
        p = plan(key, ids, num_layers, tab)
        out.append({"arch": key, "file": rule["module"], "rule": p.rule, "layers_to_capture": p.layers_to_capture,
                    "slots": p.slot_hf_indices, "problems": p.problems, "crash": p.crash})
    return out
