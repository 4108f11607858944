"""The engine's own speculative-decoding acceptance, as a live plugin writes it beside its captures.

One file per TP group, DIR/dp{D}-pp{P}/acceptance.json (written by TP rank 0, replaced atomically as the run
goes on), schema `tpprobe.acceptance/1`. The counts are the engine's own, under the names of vLLM's
`SpecDecodingStats` so both engines read alike:

  engine                      "sglang 0.5.23", "vllm 0.32.0", ...
  counted_at                  where the engine counts them (a file:line of the engine)
  num_spec_tokens             draft tokens proposed per draft (per request and verify); None if unknown
  run                         the run so far: num_drafts (one per request per verify), num_draft_tokens,
                              num_accepted_tokens, num_accepted_tokens_per_pos [k], acceptance_rate
                              (accepted / draft tokens), mean_acceptance_length (1 + accepted / drafts: the
                              tokens each verify commits, the bonus token included)
  steps                       the first MAX_STEPS verifies: {forward, num_drafts, num_accepted_tokens,
                              num_accepted_tokens_per_pos, requests: [{rid, accepted}]}; `forward` is the
                              plugin's forward index when counted (the captures' step-N)

`tpprobe report DIR` reads every acceptance.json under DIR (`read_all`) and shows the sum beside the verdict.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

SCHEMA = "tpprobe.acceptance/1"
FILE = "acceptance.json"
MAX_STEPS = 256


class Acceptance:
    """Counts of one TP group: `add(forward, [(rid, accepted drafts)])` per verify."""

    def __init__(self, engine: str, counted_at: str, num_spec_tokens: Optional[int]):
        self.engine, self.counted_at, self.k = engine, counted_at, num_spec_tokens
        self.drafts = self.accepted = 0
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
        if len(self.steps) < MAX_STEPS:
            self.steps.append({"forward": forward, "num_drafts": len(accepted),
                               "num_accepted_tokens": sum(a for _, a in accepted), "num_accepted_tokens_per_pos": per,
                               "requests": [{"rid": r, "accepted": a} for r, a in accepted]})

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "engine": self.engine, "counted_at": self.counted_at, "num_spec_tokens": self.k,
                "run": totals(self.drafts, self.accepted, self.per_pos, self.k), "steps": self.steps}


def totals(drafts: int, accepted: int, per_pos: list, k: Optional[int]) -> dict:
    draft_tokens = drafts * k if k else None
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": list(per_pos),
            "acceptance_rate": (accepted / draft_tokens) if draft_tokens else None,
            "mean_acceptance_length": (1 + accepted / drafts) if drafts else None}


def write(folder: Path, doc: dict) -> Path:
    """DIR/.../acceptance.json, replaced atomically (a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    tmp = folder / f".{FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def read_all(root: Path) -> Optional[dict]:
    """Every acceptance.json under `root` (or beside it: a step folder's TP group), summed; None when none.
    A file that cannot be read is named in `unreadable`, never a crash."""
    root = Path(root)
    files = sorted(root.rglob(FILE)) if root.is_dir() else []
    if not files and (root.parent / FILE).exists():
        files = [root.parent / FILE]
    if not files:
        return None
    docs, bad = [], []
    for f in files:
        try:
            d = json.loads(f.read_text())
            if d.get("schema") != SCHEMA:
                raise ValueError(f"schema {d.get('schema')!r}")
            docs.append((f, d))
        except Exception as e:  # noqa: BLE001 - a damaged file is named, the report goes on
            bad.append(f"{f}: {type(e).__name__}: {e}")
    if not docs:
        return {"unreadable": bad}
    ks = {d.get("num_spec_tokens") for _, d in docs}
    k = ks.pop() if len(ks) == 1 else None
    drafts = sum(d["run"]["num_drafts"] for _, d in docs)
    accepted = sum(d["run"]["num_accepted_tokens"] for _, d in docs)
    n = max(len(d["run"]["num_accepted_tokens_per_pos"]) for _, d in docs)
    per = [sum((d["run"]["num_accepted_tokens_per_pos"] + [0] * n)[j] for _, d in docs) for j in range(n)]
    return {"engine": docs[0][1].get("engine"), "counted_at": docs[0][1].get("counted_at"), "num_spec_tokens": k,
            "files": [str(f) for f, _ in docs], "run": totals(drafts, accepted, per, k),
            "steps": [s for _, d in docs for s in d.get("steps", [])][:MAX_STEPS], "unreadable": bad}


def summary(acc: dict) -> str:
    """One line: the engine's acceptance over the run."""
    if not acc.get("run"):
        return "unreadable: " + "; ".join(acc.get("unreadable") or [])
    r = acc["run"]
    if not r["num_drafts"]:
        return f"no verify counted yet ({acc.get('engine')})"
    rate = "?" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
    pos = ", ".join(f"{n / r['num_drafts']:.2f}" for n in r["num_accepted_tokens_per_pos"])
    return (f"{acc.get('engine')}: {r['num_drafts']} drafts of {acc.get('num_spec_tokens') or '?'} tokens, "
            f"{r['num_accepted_tokens']} accepted: acceptance rate {rate}, mean acceptance length "
            f"{r['mean_acceptance_length']:.2f}; per position [{pos}] (counted at {acc.get('counted_at')})")


def attach(rep: dict, path: Path) -> None:
    """Put the engine's acceptance found at `path` (a run folder, or a step folder beside its group's file)
    into a report document: `acceptance` (the counts) and one line in its settings, which every sink shows."""
    acc = read_all(Path(path))
    if acc:
        rep["acceptance"] = acc
        rep["settings"] = {**(rep.get("settings") or {}), "engine acceptance": summary(acc)}
