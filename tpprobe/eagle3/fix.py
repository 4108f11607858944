"""Which EAGLE-3 ids to write: the draft replayed on candidate captures of the target's own streams.

A draft was trained on some streams of its target (an ordered list of HF `hidden_states` indices:
0 = the embedding output, k = layer k-1's output, the residual stream, before the final norm for k =
L). Its config's ids, under the serving engine's capture rule, give it other streams when the two
disagree (catalogue F7, F8, F13, F19, F26, F30, F32) — with no error and low acceptance. Only the
draft can tell what it was trained on: this module replays it, teacher-forced (the estimate of
tpprobe.eagle3.accept), on captures assembled from the target's per-layer streams for candidate
stream lists, ranks them by replayed acceptance, and turns the best into ids for the engine (its
rule inverted), or says that no id list gives it and which engine function to patch.

Candidates (stream lists, one index per draft slot), built around what the engine gives now:
  * what the engine captures for the config's ids now (the baseline);
  * the config's ids read as the output-of-layer convention (id k = HF hidden_states[k+1], -1 = the
    embedding; SpecForge's) and as the capture-before convention (id k = HF hidden_states[k]), each in
    the written order and in layer order;
  * each of those with every slot moved by -1, 0 or +1 (all combinations);
  * each with its lowest slot replaced by the embedding, and (when it holds the embedding) without it;
  * with `trained_on` (a SpecForge sample or packed capture of the same tokens): its slots matched to
    the nearest stream.
Ranked by replayed first-position acceptance (the draft's top-1 at chain position 1), then accept
length for a chain of `chain`, then the fewest slots moved from the engine's current capture.

API (every function takes in-memory objects; the `*_from_*` helpers read files, never executing code):

    streams = streams_from_capture(DIR, rank=0)                # a probe/plugin capture with every layer
    streams = streams_from_tensors(input_ids, {0: embed, 1: layer0_out, ...}, num_layers=L)
    draft   = load_draft(DRAFT_DIR)                            # tpprobe.eagle3.accept.draft (safetensors)
    rule    = EngineRule("sglang" | "vllm", arch, num_layers, id_rule={-1: 0})   # id_rule: a patched build
    prop    = propose(draft, streams, rule, ids=None, chain=5, trained_on=None, engine="torch")
    prop.line            # "set eagle_aux_hidden_state_layer_ids to [0, 3, 31]: replayed first-position
                         #  acceptance 0.02 -> 1.00 (accept length, chain of 5: 1.02 -> 6.00)"
    prop.fix_ids         # [0, 3, 31], or None when no id list gives the best candidate
    prop.no_fix          # None, or why no id list fits and what to patch
    prop.current         # Candidate: the engine's capture now (streams, score)
    prop.best            # Candidate: the best replayed stream list
    prop.candidates      # every Candidate, ranked (streams, ids for this engine or None, score)
    prop.as_dict()       # JSON-ready (schema tpprobe.fix/1)
    run_fix(draft_dir, capture, engine, arch=None, ...)        # the command's data from paths

`engine=` takes the draft forward to use (default: tpprobe.eagle3.accept's `Eagle3Forward(draft)` on
CPU; pass `Eagle3Forward(draft, torch.device("cuda"))` on a GPU). `replay(draft, streams, stream_list)`
scores one stream list; `ids_for(rule, stream_list)` inverts an
engine's rule (None when no id list gives those slots in that order).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..core.errors import UsageError
from ..engines.capture_rule import EngineRule, config_field, ids_for, unreachable

__all__ = ["Streams", "streams_from_tensors", "streams_from_capture", "EngineRule", "ids_for", "replay", "Score",
           "Candidate", "candidates", "match_trained", "Proposal", "propose", "run_fix"]

SCHEMA = "tpprobe.fix/1"
FIELD = "eagle_aux_hidden_state_layer_ids"


# ---- the target's streams ------------------------------------------------------------------------
@dataclass
class Streams:
    """The target's residual streams for one token sequence, by HF hidden_states index."""
    input_ids: torch.Tensor                   # [T] int64
    by_hf: dict                               # HF hidden_states index -> [T, H]
    num_layers: int
    source: str = "tensors"
    # the target's own greedy token after each position (target_head.greedy_next), when its head was read: the
    # draft is then scored against it, at the positions where the prompt goes on as the target would
    next_ids: Optional[torch.Tensor] = None

    @property
    def decode_like(self) -> int:
        """Positions t whose next prompt token is the target's own choice (all of them without next_ids): there
        the draft reads what it reads in decode, (features t, the target's token t+1)."""
        ids, nxt = self.input_ids, self.next_ids
        if nxt is None:
            return max(0, ids.numel() - 2)
        return int((ids[1:] == nxt[:-1]).sum())

    @property
    def longest_chain(self) -> int:
        """The longest chain a replay can start somewhere: T-2 positions have a label (features t, token t+1,
        token t+2); with next_ids, the longest run of positions where the prompt goes on as the target would."""
        ids, nxt = self.input_ids, self.next_ids
        if nxt is None:
            return max(0, ids.numel() - 2)
        best = run = 0
        for ok in (ids[1:] == nxt[:-1]).tolist():
            run = run + 1 if ok else 0
            best = max(best, run)
        return best

    @property
    def hidden(self) -> int:
        return int(next(iter(self.by_hf.values())).shape[-1])

    def packed(self, hfs) -> torch.Tensor:
        return torch.cat([self.by_hf[h] for h in hfs], dim=-1)


def streams_from_tensors(input_ids, by_hf: dict, num_layers: Optional[int] = None, source: str = "tensors"
                         ) -> Streams:
    """Streams from memory: `by_hf` maps an HF hidden_states index (0 = the embedding output, k = layer
    k-1's output before the final norm) to a [tokens, hidden] tensor."""
    ids = torch.as_tensor(input_ids).reshape(-1).to(torch.int64)
    if not by_hf:
        raise UsageError(f"{source}: no streams; expected the embedding output and every layer's output")
    out = {}
    for h, t in by_hf.items():
        t = torch.as_tensor(t)
        if t.dim() == 3 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 2 or t.shape[0] != ids.numel():
            raise UsageError(f"{source}: stream HF hidden_states[{h}] is {list(t.shape)}, expected "
                             f"[{ids.numel()} tokens, hidden]")
        out[int(h)] = t.float()
    L = int(num_layers) if num_layers is not None else max(out)
    return Streams(ids, dict(sorted(out.items())), L, source)


def streams_from_capture(path, rank: int = 0) -> Streams:
    """Every layer's stream of one rank of a tpprobe capture folder (probe or plugin step folder):
    embed.out = HF hidden_states[0], layer.K.out = hidden_states[K+1]."""
    from ..capture.points import EMBED_OUT, INPUT_IDS, parse
    from ..core.errors import CaptureError
    from ..formats.capture_dir import load_run
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"--streams {path}: not a folder; expected a tpprobe capture folder with every layer's "
                         f"stream (tpprobe probe, or a plugin step folder)")
    if not (path / "manifest.json").exists() and (path / f"rank-{rank:03d}.json").exists():
        return _streams_from_drafter(path, rank)
    run = load_run(path)
    if rank not in run.records:
        raise CaptureError(f"{path}: rank {rank} is not in this capture (readable ranks: {sorted(run.records)})")
    t = run.records[rank].tensors
    if INPUT_IDS not in t:
        raise CaptureError(f"{path}: no input_ids in rank {rank}'s file; the draft is replayed on a token sequence "
                           f"(a plugin step keeps the ids and every layer's stream with TPPROBE_KEEP='*' and a "
                           f"TPPROBE_MAX_BYTES that admits them; its drafter/ folder holds them too)")
    by = {}
    for name, v in t.items():
        p = parse(name)
        if name == EMBED_OUT:
            by[0] = v
        elif p.is_stream and p.layer is not None and p.layer >= 0 and name.endswith(".out"):
            by[p.layer + 1] = v
    s = run.manifest.get("settings") or {}
    L = s.get("num_layers") or (max(by) if by else None)
    if 0 not in by or not L or len(by) < int(L) + 1:
        have = sorted(by)
        raise CaptureError(f"{path}: the streams of HF hidden_states {have} only, expected 0..{L} (the embedding "
                           f"and every layer's output); capture every layer (tpprobe probe keeps them by default)")
    return streams_from_tensors(t[INPUT_IDS], by, L, str(path))


def _streams_from_drafter(path: Path, rank: int) -> Streams:
    """The streams a vLLM plugin step's drafter/ folder kept (stream.K = HF hidden_states[K] and the target's
    token ids, rows of every request of the batch): the longest prompt's rows, one token sequence."""
    import json

    from safetensors.torch import load_file

    from ..core.errors import CaptureError
    from ..engines.vllm.draft_streams import prompt_rows, prompt_streams
    meta = json.loads((path / f"rank-{rank:03d}.json").read_text())
    if not isinstance(meta, dict) or "drafter" not in str(meta.get("source", "")):
        raise UsageError(f"--streams {path}: not a tpprobe capture folder (no manifest.json) nor a vLLM plugin step's "
                         f"drafter/ folder")
    f = path / f"rank-{rank:03d}.safetensors"
    t = load_file(str(f)) if f.exists() else {}
    prompts = prompt_rows(meta.get("requests"))
    if "target_token_ids" not in t or not any(k.startswith("stream.") for k in t) or not prompts:
        raise CaptureError(f"{path}: this step's drafter files kept no prompt with its streams (capture a prefill with "
                           f"TPPROBE_KEEP='*' and a TPPROBE_MAX_BYTES that admits every layer's stream)")
    lo, hi = prompts[0]
    ids, by = prompt_streams(t, lo, hi)
    return streams_from_tensors(ids, by, meta.get("num_layers"), f"{path}, prompt rows {lo}..{hi - 1}")


# ---- replay --------------------------------------------------------------------------------------------
@dataclass
class Score:
    first_position: float            # the draft's top-1 = the target's next-next token, chain position 1
    accept_length: float             # 1 + expected accepted drafts, chain of `chain`
    chain: int
    per_position: list = field(default_factory=list)    # acceptance at chain positions 1..chain

    def as_dict(self) -> dict:
        return {"first_position": self.first_position, "accept_length": self.accept_length, "chain": self.chain,
                "per_position": self.per_position}


def replay(draft, streams: Streams, hfs: list[int], chain: int = 5, engine=None) -> Score:
    """The draft, teacher-forced, on the streams `hfs` (one per slot): tpprobe.eagle3.accept's estimate."""
    from .accept.engines import Eagle3Forward
    from .accept.score import accept_lengths, agreement
    eng = engine if engine is not None else Eagle3Forward(draft)
    if streams.next_ids is not None:
        return _replay_on_target(eng, draft, streams, hfs, chain)
    agree = agreement(eng, draft, streams.packed(hfs), streams.input_ids)
    acc = accept_lengths(agree, (chain,))
    a = agree.tolist()
    starts = range(0, len(a) - chain + 1)
    # position k of a chain is accepted when positions 1..k all are (the leading run reaches k)
    per = [round(sum(all(a[t:t + k]) for t in starts) / max(1, len(starts)), 6) for k in range(1, chain + 1)]
    return Score(float(agree.float().mean()), 1.0 + (acc[chain] or 0.0), chain, per)


def _replay_on_target(eng, draft, streams: Streams, hfs: list[int], chain: int) -> Score:
    """The draft at t (features t, token t+1) against the target's own token after t+1, at the positions where
    token t+1 is the target's own choice after t (as in decode); a chain counts from a start whose whole window
    is such positions."""
    from .accept.score import ieee_fp32
    ids, nxt = streams.input_ids, streams.next_ids
    T = ids.numel()
    dev = getattr(eng, "device", torch.device("cpu"))
    with torch.no_grad(), ieee_fp32(dev):
        top = eng.logits(streams.packed(hfs)[: T - 1].to(dev), ids[1:T].to(dev)).argmax(-1).cpu()
    top = draft.to_target(top)
    agree = (top == nxt[1:T]).tolist()             # t in 0..T-2
    ok = (ids[1:T] == nxt[: T - 1]).tolist()
    n = len(agree)
    first = [a for a, m in zip(agree, ok) if m]
    starts = [t for t in range(0, n - chain + 1) if all(ok[t:t + chain])]
    runs = []
    for t in starts:
        r = 0
        while r < chain and agree[t + r]:
            r += 1
        runs.append(r)
    per = [round(sum(r >= k for r in runs) / max(1, len(runs)), 6) for k in range(1, chain + 1)]
    return Score(sum(first) / max(1, len(first)), 1.0 + (sum(runs) / len(runs) if runs else 0.0), chain, per)


# ---- candidates ------------------------------------------------------------------------------------
SHOWN = 8        # candidates the table shows, best first: each with the ids that give it, or none do
GAIN = 0.05      # first-position acceptance a candidate must gain over the engine's capture to be a fix


@dataclass
class Candidate:
    streams: list[int]                # HF index per slot, slot order
    label: str                        # how it was made
    score: Optional[Score] = None
    ids: Optional[list[int]] = None   # ids that give it on this engine (None: none do, or not searched)
    moved: int = 0                    # slots that differ from the engine's current capture
    searched: bool = False            # ids were searched for it (the best SHOWN candidates, and on to a fix)

    def as_dict(self) -> dict:
        return {"streams": self.streams, "label": self.label, "ids": self.ids, "ids_searched": self.searched,
                "moved": self.moved, "score": self.score.as_dict() if self.score else None}


def candidates(written: list[int], current: Optional[list[int]], L: int, trained: Optional[list[int]] = None,
               config: Optional[list[int]] = None) -> list[Candidate]:
    """Candidate stream lists around the engine's capture and the two readings of the written ids (and of the
    draft's own config ids, `config`, when the ids served are others)."""
    k = len(written)
    bases: list[tuple[list[int], str]] = []
    if current is not None and len(current) == k:
        bases.append((list(current), "the engine's now"))
    readings = [(written, "ids")]
    if config and len(config) == k and list(config) != list(written):
        readings.append((list(config), "the draft's config ids"))
    for ids, name in readings:
        for hf, what in (([i + 1 for i in ids], f"{name} as outputs (k = hs[k+1])"),
                         (list(ids), f"{name} as inputs (k = hs[k])")):
            bases.append((hf, what))
            if sorted(hf) != hf:
                bases.append((sorted(hf), what + " in layer order"))
    if trained is not None:
        bases.insert(0, (list(trained), "the training sample"))
    seen: dict[tuple, Candidate] = {}

    def add(hf, label):
        t = tuple(hf)
        if len(set(t)) != len(t) or not all(0 <= h <= L for h in t) or t in seen:
            return
        seen[t] = Candidate(list(t), label)
    for hf, label in bases:
        add(hf, label)
    for hf, label in bases:
        for delta in itertools.product((-1, 0, 1), repeat=k):
            if any(delta):
                moved = " ".join(f"slot {i} {d:+d}" for i, d in enumerate(delta) if d)
                add([h + d for h, d in zip(hf, delta)], f"{label}, {moved}")
    for c in list(seen.values()):
        lo = c.streams.index(min(c.streams))
        if 0 not in c.streams:
            add([0 if i == lo else h for i, h in enumerate(c.streams)], f"{c.label}, slot {lo} = embedding")
        else:
            add([1 if h == 0 else h for h in c.streams], f"{c.label}, no embedding (layer 0's output)")
    return list(seen.values())


def match_trained(streams: Streams, packed: torch.Tensor) -> list[int]:
    """Each slot of a training sample (packed [T, K*H]) -> the stream nearest to it (relative error)."""
    H = streams.hidden
    if packed.shape[-1] % H or packed.shape[0] != streams.input_ids.numel():
        raise UsageError(f"--trained-on: its features are {list(packed.shape)}, expected [{streams.input_ids.numel()}"
                         f" tokens, K × {H}] (the same tokens as the streams)")
    out = []
    for sl in packed.float().split(H, dim=-1):
        errs = {h: float((s - sl).norm() / (sl.norm() + 1e-12)) for h, s in streams.by_hf.items()}
        out.append(min(errs, key=errs.get))
    return out


# ---- the proposal ------------------------------------------------------------------------------------
@dataclass
class Proposal:
    rule: EngineRule
    written: list[int]
    current: Candidate
    best: Candidate
    candidates: list[Candidate]
    fix_ids: Optional[list[int]]
    no_fix: Optional[str]
    line: str
    reachable: Optional[Candidate] = None     # the best candidate this engine can give (when best cannot)
    notes: list = field(default_factory=list)

    @property
    def explained(self) -> bool:
        """The current ids lose acceptance that another capture recovers."""
        return self.best.score.first_position > self.current.score.first_position + GAIN if (
            self.best.score and self.current.score) else False

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "engine": self.rule.engine, "arch": self.rule.arch,
                "num_layers": self.rule.num_layers, "id_rule": self.rule.id_rule, "written_ids": self.written,
                "current": self.current.as_dict(), "best": self.best.as_dict(), "fix_ids": self.fix_ids,
                "no_fix": self.no_fix, "line": self.line, "explained": self.explained,
                "reachable": self.reachable.as_dict() if self.reachable else None, "notes": self.notes,
                "candidates": [c.as_dict() for c in self.candidates]}


def _order_key(c: Candidate):
    return (-round(c.score.first_position, 6), -round(c.score.accept_length, 6), c.moved)


def _slot_moves(hfs: list[int]) -> str:
    srt = sorted(hfs)
    return ", ".join(f"slot {i} would hold HF hidden_states[{srt[i]}] instead of [{h}]"
                     for i, h in enumerate(hfs) if srt[i] != h)


def propose(draft, streams: Streams, rule: EngineRule, ids: Optional[list[int]] = None, chain: int = 5,
            trained_on: Optional[torch.Tensor] = None, engine=None, max_candidates: int = 400) -> Proposal:
    """Rank candidate captures by the draft's replayed acceptance and turn the best into ids for `rule`."""
    from .accept.engines import Eagle3Forward
    cfg_field = config_field(rule.engine)
    written = list(ids if ids is not None else (draft.layer_ids or []))
    if not written:
        raise UsageError(f"the draft's config has no {cfg_field}: pass the ids it is served with (--ids)")
    if len(written) != draft.k:
        raise UsageError(f"{len(written)} ids {written} but the draft's fc takes {draft.k} slots: give one id per slot")
    if streams.hidden != draft.target_hidden:
        raise UsageError(f"the streams are {streams.hidden} wide, the draft's target_hidden_size is "
                         f"{draft.target_hidden}: are they the streams of this draft's target?")
    rule.plan(written, strict=True)      # a rule outside the engine's code, ids not covered: said before the replay
    ids_t = streams.input_ids
    if ids_t.numel() and (int(ids_t.max()) >= draft.vocab or int(ids_t.min()) < 0):
        raise UsageError(f"the token sequence has ids up to {int(ids_t.max())}, outside the draft's vocabulary "
                         f"[0, {draft.vocab}): is this the draft of another model?")
    if streams.num_layers != rule.num_layers:
        raise UsageError(f"the streams come from a model of {streams.num_layers} layers, the engine's rule is for "
                         f"{rule.num_layers}: give the target's num_layers")
    L = rule.num_layers
    eng = engine if engine is not None else Eagle3Forward(draft)
    now = rule.slots(written)
    plan = rule.plan(written)
    notes = []
    if now is None:
        notes.append(f"the engine does not serve these ids as they are: {'; '.join(plan.problems) or plan.crash}")
    trained = match_trained(streams, trained_on) if trained_on is not None else None
    cands = candidates(written, now, L, trained, list(draft.layer_ids or []))[:max_candidates]
    cur = next((c for c in cands if now is not None and c.streams == now), None)
    for c in cands:
        c.score = replay(draft, streams, c.streams, chain, eng)
        c.moved = len(c.streams) if now is None else sum(a != b for a, b in zip(c.streams, now))
    if cur is None:       # the engine crashes, drops an id, or gives a slot count the draft cannot take
        cur = Candidate(list(now or []), "the engine's now", Score(0.0, 1.0, chain, [0.0] * chain))
    cands.sort(key=_order_key)
    best = cands[0]
    for c in cands[:SHOWN]:
        c.ids, c.searched = ids_for(rule, c.streams, written, any_order=c is best), True
    # of candidates that replay alike, one the engine can give goes first: the fix is then its ids, not a
    # capture no id list gives with the same acceptance
    cands[:SHOWN] = sorted(cands[:SHOWN], key=lambda c: (*_order_key(c)[:2], c.ids is None, c.moved))
    best = cands[0]
    best_ids = best.ids
    reachable = None
    no_fix = None
    cs, bs = cur.score, best.score
    head = (f"replayed first-position acceptance {cs.first_position:.2f} -> {bs.first_position:.2f} (accept "
            f"length, chain of {chain}: {cs.accept_length:.2f} -> {bs.accept_length:.2f})")
    if best.streams == (now or []) and now is not None:
        line = (f"keep {cfg_field} {written}: no candidate capture replays better than the engine's "
                f"({cs.first_position:.2f} first-position acceptance, accept length {cs.accept_length:.2f}, chain "
                f"of {chain})")
        fix_ids = None
    elif now is not None and bs.first_position <= cs.first_position + GAIN:
        # what the exit code says too (Proposal.explained): a gain this small is no capture to change
        line = (f"keep {cfg_field} {written}: the best candidate capture, HF hidden_states{best.streams}, replays "
                f"within {GAIN} of the engine's ({head}): the capture does not explain a low acceptance")
        fix_ids = None
    elif best_ids is not None:
        fix_ids = best_ids
        line = f"set {cfg_field} to {best_ids}: {head}"
    else:
        fix_ids = None
        reachable = next((c for c in cands if c.ids is not None), None)
        for c in cands[SHOWN:30]:
            if reachable is not None:
                break
            c.ids, c.searched = ids_for(rule, c.streams, written, any_order=False), True
            reachable = c if c.ids is not None else None
        why = []
        if sorted(best.streams) != best.streams:
            why.append(f"the draft reads its slots in the order HF hidden_states{best.streams}, and this engine "
                       f"fills slots in ascending layer order ({_slot_moves(best.streams)}): permute the column "
                       f"blocks of the draft's fc.weight to layer order, or patch {rule.patch_point()}")
        why += [w if "--id-rule" in w else f"{w} (or describe a patched build with --id-rule)"
                for w in unreachable(rule, best.streams)]
        if not why:
            why.append(f"no id list gives HF hidden_states{best.streams} in this order on this engine: patch "
                       f"{rule.patch_point()}")
        no_fix = "; ".join(why)
        line = f"the draft replays best on HF hidden_states{best.streams} ({head}), but {no_fix}"
        if reachable is not None and reachable.streams != (now or []):
            rs = reachable.score
            line += (f"; the best this engine can give: set {cfg_field} to {reachable.ids} (first-position acceptance "
                     f"{rs.first_position:.2f}, accept length {rs.accept_length:.2f})")
    return Proposal(rule, written, cur, best, cands, fix_ids, no_fix, line, reachable, notes)


# ---- the command -------------------------------------------------------------------------------------
def run_fix(draft_dir, streams_path, engine: str, arch: Optional[str] = None, num_layers: Optional[int] = None,
            ids: Optional[list[int]] = None, id_rule: Optional[dict] = None, trained_on=None, rank: int = 0,
            chain: int = 5, embed: Optional[str] = None, target: Optional[str] = None) -> dict:
    """`tpprobe fix`'s data from paths: the draft folder, a capture folder with every layer's stream,
    the engine (sglang | vllm) and the target's architecture (default: the capture's). `target`: the target
    model's folder, when known: the draft is then scored against the target's own greedy tokens (its final norm
    and head on the captured last layer, tpprobe.eagle3.target_head), as the live report's replay scores it;
    else against the prompt's next tokens. `scored_against` says which."""
    from .accept.draft import load_draft
    from .target_head import score_on_target
    d = load_draft(draft_dir, embed)
    s = streams_from_capture(streams_path, rank)
    if target:
        scored, why = score_on_target(s, target)
        if why:
            raise UsageError(f"--streams {streams_path}: {why}")
    else:
        scored = ("scored against the prompt's next tokens (the target's folder was not given: --embed or "
                  "--target-config naming it scores against the target's own greedy tokens)")
    if chain > s.longest_chain:     # no start position fits it: every candidate would read accept length 1.00
        n = s.input_ids.numel()
        fits = f"give --chain {s.longest_chain} or less, or " if s.longest_chain else ""
        raise UsageError(f"--chain {chain}: no start position of the {n}-token capture {streams_path} fits a chain "
                         f"of {chain} ({s.longest_chain} positions have a next-next token to score a draft against); "
                         f"{fits}capture a longer sequence")
    if arch is None:
        raise UsageError("--arch: give the target's architecture as in its config.json (e.g. "
                         "DeepseekV3ForCausalLM, LlamaForCausalLM) so the engine's capture rule applies")
    rule = EngineRule(engine, arch, int(num_layers or s.num_layers), dict(id_rule or {}))
    tr = None
    if trained_on is not None:
        from .diff.load import load_side
        tr = load_side("trained-on", trained_on, rank).packed
    p = propose(d, s, rule, ids, chain, tr)
    doc = p.as_dict()
    doc["draft"] = str(d.path)
    doc["streams_from"] = s.source
    doc["scored_against"] = scored
    doc["tokens"] = int(s.input_ids.numel())
    doc["exit_code"] = 1 if (p.fix_ids is not None or p.no_fix) and p.explained else 0
    return doc
