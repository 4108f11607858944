"""What an EAGLE-3 draft was trained on, as the user says it, and the slots each aux slot must then hold.

A live capture can prove that the engine captures what the draft's config says (the engine's rule applied
to `eagle_aux_hidden_state_layer_ids`); only what the draft was trained on can prove the config right
(catalogue F32: every check healthy, the config not what the draft was trained on). The user says it in the
engine plugin's environment, with the grammar of the vLLM side (tpprobe/engines/vllm/acceptance.py):

  TPPROBE_DRAFT_TRAINED=ids:A,B,C          the HF `hidden_states` indices the draft was trained on, in slot order
                                           (0 = the embedding output, k = layer k-1's output); `A,B,C` alone too
  TPPROBE_DRAFT_TRAINED=convention:NAME    the draft config's own ids read in a training convention, slots in
                                           the ids' written order: `output` (SpecForge's: id k = layer k's
                                           output = hidden_states[k+1]), `before` (id k = the input of layer k
                                           = hidden_states[k]), `vllm` (vLLM's rule: id k = hidden_states[k],
                                           sorted, each once)
  TPPROBE_DRAFT_TRAINED=specforge:PATH     a SpecForge EAGLE-3 training sample (`data_<i>.ckpt`, `.ckpt.gz`, read
                                           with torch.load(weights_only=True) by tpprobe.formats.specforge): its
                                           `aux_hidden_state` slots are matched, on the tokens it shares with a
                                           captured prefill, to that forward's streams (`match_sample`); the
                                           sample's tokens must have been served (send its `input_ids` as a
                                           prompt)

Not given: the expected slots are the draft config's ids under the engine's rule, and the report says the
draft was checked against its config only (kind `draft-unverified`, a warning): never HEALTHY for the draft
from the engine agreeing with itself.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..capture.points import EMBED_OUT, layer_out
from ..core.errors import UsageError

ENV = "TPPROBE_DRAFT_TRAINED"
CONVENTIONS = ("output", "before", "vllm")


def hs_point(h: Optional[int]) -> Optional[str]:
    """tpprobe's capture point equal to HF hidden_states[h] (0: the embedding output)."""
    if h is None:
        return None
    return EMBED_OUT if h == 0 else layer_out(h - 1)


def hs_of_point(p: Optional[str]) -> Optional[int]:
    if p is None:
        return None
    if p == EMBED_OUT:
        return 0
    if p.startswith("layer.") and p.endswith(".out"):
        return int(p.split(".")[1]) + 1
    return None


def parse(spec: Optional[str]) -> Optional[dict]:
    """The training a TPPROBE_DRAFT_TRAINED value says: {"hidden_states": [...]} or {"convention": ...}, with
    "from"; None when empty. Bad text: UsageError (one line: what is wrong, what to write)."""
    spec = (spec or "").strip()
    if not spec:
        return None
    kind, _, val = spec.partition(":")
    if not val:
        kind, val = "ids", spec
    kind = kind.strip().lower()
    if kind == "ids":
        try:
            vals = [int(x) for x in val.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"{ENV}={spec!r}: ids:A,B,C takes integers (the HF hidden_states indices the draft was "
                             f"trained on, in slot order)") from None
        if not vals or min(vals) < 0:
            raise UsageError(f"{ENV}={spec!r}: hidden_states indices are >= 0 (0 = the embedding output)")
        return {"hidden_states": vals, "from": f"{ENV}={spec}"}
    if kind == "convention":
        conv = val.strip().lower()
        if conv not in CONVENTIONS:
            raise UsageError(f"{ENV}={spec!r}: conventions are {', '.join(CONVENTIONS)}")
        return {"convention": conv, "from": f"{ENV}={spec}"}
    if kind == "specforge":
        return {"specforge": val.strip(), "from": f"{ENV}={spec}"}
    raise UsageError(f"{ENV}={spec!r}: give ids:A,B,C (HF hidden_states indices in slot order), "
                     f"convention:{'|'.join(CONVENTIONS)} or specforge:PATH (a SpecForge training sample)")


def from_env(env=None) -> Optional[dict]:
    """`parse` of TPPROBE_DRAFT_TRAINED in `env` (default: this process's environment)."""
    if env is None:
        from ..config.knobs import knob
        return parse(knob(ENV))
    return parse(env.get(ENV))


def trained_hidden_states(training: Optional[dict], config_ids: Optional[list[int]]) -> Optional[list[int]]:
    """The HF hidden_states index of each slot the draft was trained on (slot order), or None (unknown)."""
    if not training:
        return None
    if "hidden_states" in training:
        return list(training["hidden_states"])
    if "specforge" in training:      # matched to a forward's streams: match_sample
        return None
    if config_ids is None:
        return None
    if training["convention"] == "vllm":
        return sorted({int(i) for i in config_ids})
    shift = 1 if training["convention"] == "output" else 0
    return [int(i) + shift for i in config_ids]


def slot_count_mismatch(spec: str, trained: list[int], config_ids: Optional[list[int]], n_slots: Optional[int],
                        field: str, received: str) -> str:
    """'' when the training (`spec`, what follows `TPPROBE_DRAFT_TRAINED=`) gives the draft one stream per slot; else
    the line that refuses it, naming both lengths. The draft's slots: its config's ids in `field` (what its fc
    reads), else `n_slots`, `received` saying what they are (the slots the drafter received)."""
    n = len(config_ids) if config_ids else n_slots
    if not n or len(trained) == n:
        return ""
    of = f"its config's {field} {list(config_ids)}" if config_ids else received
    return (f"{ENV}={spec} gives {len(trained)} slot(s), HF hidden_states {list(trained)}, but the draft reads {n} "
            f"({of}): give one HF hidden_states index per slot, in slot order")


SAMPLE_MATCH = 0.05      # a sample's slot IS a stream when ||slot - stream|| / ||slot|| is under this (another
                         # engine or dtype wrote the sample: bf16 rounding is ~0.4 %, a neighbouring layer ~50 %+)
MIN_SHARED = 2           # tokens a sample must share with a captured prefill, from its first


def load_sample(path: str):
    """(input_ids [T], aux_hidden_state [T, K*H]) of a SpecForge sample; UsageError when unreadable or
    without input_ids (the slots are matched on the tokens)."""
    from ..core.errors import CaptureError
    from ..formats.specforge import read_sample
    from pathlib import Path
    if not Path(path).is_file():
        raise UsageError(f"{ENV}=specforge:{path}: no such file; give a SpecForge EAGLE-3 sample "
                         f"(rows_<a>-<b>/data_<i>.ckpt, written with --enable-aux-hidden-states)")
    try:
        s = read_sample(path)
    except CaptureError as e:
        msg = str(e)
        raise UsageError(f"{ENV}=specforge:{path}: {msg[len(str(path)) + 2:] if msg.startswith(str(path)) else msg}"
                         ) from None
    if "input_ids" not in s:
        raise UsageError(f"{ENV}=specforge:{path}: the sample has no input_ids; its slots are matched to the "
                         f"target's streams on the tokens it holds")
    return s["input_ids"].reshape(-1).long(), s["aux_hidden_state"].float()


def match_sample(path: str, forwards) -> tuple[Optional[list[int]], str]:
    """The HF hidden_states index of each slot of the SpecForge sample at `path`, matched on the tokens it
    shares (from its first) with one of `forwards` (token ids [T], {HF index: [T, H] stream}, where): the
    forward sharing the most tokens, each slot's nearest stream within SAMPLE_MATCH. (None, why) when no
    forward shares MIN_SHARED tokens or a slot is no stream of it."""
    import torch
    ids, aux = load_sample(path)
    best = None
    for tok, streams, where in forwards:
        tok = torch.as_tensor(tok).reshape(-1).long()
        m = min(len(tok), len(ids))
        same = (tok[:m] == ids[:m]).tolist()
        n = same.index(False) if False in same else m
        if n >= MIN_SHARED and streams and (best is None or n > best[0]):
            best = (n, streams, where)
    if best is None:
        return None, (f"the SpecForge sample {path} shares no {MIN_SHARED}+ leading tokens with a captured prefill: "
                      f"serve its input_ids (its first tokens: {ids[:8].tolist()}) as a prompt and capture it")
    n, streams, where = best
    n = min([n, *(int(s.shape[0]) for s in streams.values())])      # a capture may keep only its first rows
    if n < MIN_SHARED:
        return None, (f"the SpecForge sample {path}: the capture kept {n} rows of the prefill it shares tokens with "
                      f"({where}): raise TPPROBE_KEEP_TOKENS")
    H = int(next(iter(streams.values())).shape[-1])
    if aux.shape[-1] % H:
        return None, (f"the SpecForge sample {path}'s aux_hidden_state is {aux.shape[-1]} wide, not a multiple of "
                      f"the target's hidden size {H}: the sample of another model")
    out, errs = [], []
    for j, sl in enumerate(aux[:n].split(H, dim=-1)):
        rel = {h: float((s[:n].float() - sl).norm() / (sl.norm() + 1e-12)) for h, s in sorted(streams.items())}
        h = min(rel, key=rel.get)
        if rel[h] > SAMPLE_MATCH:
            return None, (f"slot {j} of the SpecForge sample {path} is no stream of the target's forward at {where} "
                          f"(nearest HF hidden_states[{h}], relative error {rel[h]:.2g}, over {n} shared tokens): "
                          f"the sample of another target, or of other weights")
        out.append(h)
        errs.append(rel[h])
    return out, (f"the SpecForge sample {path}: its {len(out)} slots are HF hidden_states {out} (matched to the "
                 f"target's streams at {where}, {n} shared tokens, relative error at most {max(errs):.1g})")


def propose_ids(trained_hs: list[int], slots_for: Callable[[list[int]], Optional[list[int]]],
                num_layers: int) -> tuple[Optional[list[int]], str]:
    """Ids for the draft's config that make the engine capture `trained_hs` in that slot order, found by
    asking the engine's rule (`slots_for(ids)` -> the hidden_states index of each slot, None: the ids
    crash); ([...], how) or (None, why no id list can)."""
    tried = []
    for shift in (1, 0):
        ids = [h - shift for h in trained_hs]
        got = slots_for(ids)
        tried.append((ids, got))
        if got == list(trained_hs):
            return ids, "the engine's rule applied to these ids captures exactly the trained slots"
    if list(trained_hs) != sorted(trained_hs):
        return None, (f"the draft was trained with its slots in the order of hidden_states {trained_hs}, but the "
                      f"engine fills the slots in layer order: no id list can give it that order (the draft needs "
                      f"retraining on layer order, or the engine a capture that packs in the ids' order)")
    if num_layers in trained_hs:
        return None, (f"hidden_states[{num_layers}] (the last layer's output) is not reachable by this engine's "
                      f"capture for this architecture")
    if 0 in trained_hs:
        return None, ("the draft was trained with the embedding output (hidden_states[0]) and no id reaches it on this "
                      "architecture's rule: the engine's capture would need to take the embedding (a code change in "
                      "the model's set_eagle3_layers_to_capture / its loop)")
    return None, f"no id list tried ({', '.join(str(i) for i, _ in tried)}) captures hidden_states {trained_hs}"


def basis(settings: dict) -> Optional[str]:
    """What a step's slots were checked against: `trained`, `config` (the draft's config only), `engine`
    (the engine's own capture list only), None (no draft information: not a live capture)."""
    return settings.get("draft_basis")
