"""The engine's own speculative-decoding acceptance, as a live plugin writes it beside its captures.

One file per TP group, DIR/dp{D}-pp{P}/acceptance.json, written by TP rank 0 and replaced atomically as the
run goes on. The keys are the ones the vLLM plugin writes (tpprobe/engines/vllm/drafter.py), so one reader
serves both engines:

  source                  "sglang-plugin" (the vLLM plugin's: "vllm-plugin")
  counted_at              where the engine counts them (a file:line of the engine)
  updated                 time.time() of the write
  drafts                  drafts verified (one per request per verify)
  draft_tokens            draft tokens proposed (drafts x tokens per draft; None if the engine's setting is unknown)
  accepted                draft tokens accepted (the bonus token not counted)
  accepted_per_pos        accepted drafts per position [k]
  verify_steps            verifies counted
  engine, num_spec_tokens "sglang 0.5.23", draft tokens per draft (this plugin's additions)
  steps                   the first MAX_STEPS verifies: {forward, drafts, accepted, accepted_per_pos, requests:
                          [{rid, accepted}]}; `forward` is the plugin's forward index when counted

The derived numbers (`rates`): rate = accepted / draft_tokens, mean_acceptance_length = 1 + accepted / drafts
(the tokens each verify commits, the bonus included), rate_per_pos = accepted_per_pos / drafts.
`tpprobe report DIR` reads every SGLang acceptance.json under DIR (`read_all`) and shows the sum beside the
verdict (the vLLM plugin's files are shown by its drafter section).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

SCHEMA = "tpprobe.acceptance/1"
FILE = "acceptance.json"
MAX_STEPS = 256


class Acceptance:
    """Counts of one TP group: `add(forward, [(rid, accepted drafts)])` per verify."""

    def __init__(self, engine: str, counted_at: str, num_spec_tokens: Optional[int], source: str):
        self.engine, self.counted_at, self.k, self.source = engine, counted_at, num_spec_tokens, source
        self.drafts = self.accepted = self.verifies = 0
        self.per_pos: list[int] = [0] * (num_spec_tokens or 0)
        self.steps: list[dict] = []

    def add(self, forward: int, accepted: list[tuple[str, int]]) -> None:
        per = [0] * max([self.k or 0, *(a for _, a in accepted)])
        for _, a in accepted:
            for j in range(a):
                per[j] += 1
        if len(per) > len(self.per_pos):
            self.per_pos += [0] * (len(per) - len(self.per_pos))
        for j, n in enumerate(per):
            self.per_pos[j] += n
        self.drafts += len(accepted)
        self.accepted += sum(a for _, a in accepted)
        self.verifies += 1
        if len(self.steps) < MAX_STEPS:
            self.steps.append({"forward": forward, "drafts": len(accepted), "accepted": sum(a for _, a in accepted),
                               "accepted_per_pos": per, "requests": [{"rid": r, "accepted": a} for r, a in accepted]})

    def to_json(self) -> dict:
        return {"source": self.source, "counted_at": self.counted_at, "updated": time.time(),
                "drafts": self.drafts, "draft_tokens": self.drafts * self.k if self.k else None,
                "accepted": self.accepted, "accepted_per_pos": list(self.per_pos), "verify_steps": self.verifies,
                "engine": self.engine, "num_spec_tokens": self.k, "steps": self.steps}


def rates(acc: dict) -> dict:
    """The counts with the rate, mean acceptance length and per-position rates (the vLLM side's definitions)."""
    drafts, tokens, accepted = acc.get("drafts", 0), acc.get("draft_tokens"), acc.get("accepted", 0)
    per = list(acc.get("accepted_per_pos") or [])
    return {**acc, "rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "rate_per_pos": [x / drafts for x in per] if drafts else []}


def write(folder: Path, doc: dict) -> Path:
    """DIR/.../acceptance.json, replaced atomically (a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    tmp = folder / f".{FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def read_all(root: Path, source: str = "sglang-plugin") -> Optional[dict]:
    """Every acceptance.json of `source` under `root` (or beside it: a step folder's TP group), summed, with
    `rates`; None when none. A file that cannot be read is named in `unreadable`, never a crash."""
    root = Path(root)
    files = sorted(root.rglob(FILE)) if root.is_dir() else []
    if not files and (root.parent / FILE).exists():
        files = [root.parent / FILE]
    docs, bad = [], []
    for f in files:
        try:
            d = json.loads(f.read_text())
            if not isinstance(d, dict) or not isinstance(d.get("drafts"), int):
                raise ValueError("no drafts count")
        except Exception as e:  # noqa: BLE001 - a damaged file is named, the report goes on
            bad.append(f"{f}: {type(e).__name__}: {e}")
            continue
        if d.get("source") == source:
            docs.append((f, d))
    if not docs:
        return {"unreadable": bad} if bad else None
    ks = {d.get("num_spec_tokens") for _, d in docs}
    k = ks.pop() if len(ks) == 1 else None
    n = max(len(d.get("accepted_per_pos") or []) for _, d in docs)
    tokens = [d.get("draft_tokens") for _, d in docs]
    out = {"source": source, "engine": docs[0][1].get("engine"), "counted_at": docs[0][1].get("counted_at"),
           "num_spec_tokens": k, "files": [str(f) for f, _ in docs],
           "drafts": sum(d["drafts"] for _, d in docs), "accepted": sum(d.get("accepted", 0) for _, d in docs),
           "draft_tokens": None if None in tokens else sum(tokens),
           "accepted_per_pos": [sum(((d.get("accepted_per_pos") or []) + [0] * n)[j] for _, d in docs)
                                for j in range(n)],
           "verify_steps": sum(d.get("verify_steps", 0) for _, d in docs),
           "steps": [s for _, d in docs for s in d.get("steps", [])][:MAX_STEPS], "unreadable": bad}
    return rates(out)


def summary(acc: dict) -> str:
    """One line: the engine's acceptance over the run."""
    if "drafts" not in acc:
        return "unreadable: " + "; ".join(acc.get("unreadable") or [])
    if not acc["drafts"]:
        return f"no verify counted yet ({acc.get('engine')})"
    rate = "?" if acc["rate"] is None else f"{acc['rate']:.2f}"
    pos = ", ".join(f"{x:.2f}" for x in acc["rate_per_pos"])
    of = f" of {acc['num_spec_tokens']} tokens" if acc.get("num_spec_tokens") else ""
    return (f"{acc.get('engine')}: {acc['drafts']} drafts{of}, "
            f"{acc['accepted']} accepted: acceptance rate {rate}, mean acceptance length "
            f"{acc['mean_acceptance_length']:.2f}; per position [{pos}] (counted at {acc.get('counted_at')})")


def attach(rep: dict, path: Path) -> None:
    """Put the engine's acceptance found at `path` (a run folder, or a step folder beside its group's file)
    into a report document: `acceptance` (the counts) and one line in its settings, which every sink shows."""
    acc = read_all(Path(path))
    if acc:
        rep["acceptance"] = acc
        rep["settings"] = {**(rep.get("settings") or {}), "engine acceptance": summary(acc)}
