"""The prompts a vLLM plugin step's drafter/ folder kept, as a replay of the draft reads them: one rule for
`tpprobe fix --streams DRAFTER_DIR` (tpprobe.eagle3.fix) and the live report's replay (tpprobe/cli/drafter.py).

The drafter's rank-000.safetensors (TP rank 0, tpprobe.engines.vllm.drafter) holds `target_token_ids` and
`stream.K` (HF hidden_states[K]) for every row of the step's batch; its rank-000.json's `requests` say which rows
are which request's, and which requests are prompts (a prefill). A replay reads one prompt: the longest.
"""
from __future__ import annotations

from pathlib import Path


def prompt_rows(requests, min_rows: int = 3) -> list[tuple[int, int]]:
    """(first row, end row) of every prompt (a prefill request) of `min_rows`+ tokens among a drafter file's
    `requests`, longest first (of equal length, the earlier first): the token sequences a replay of the draft can
    read."""
    rows = [tuple(r["rows"]) for r in requests or [] if r.get("kind") == "prefill" and r["rows"][1] - r["rows"][0]
            >= min_rows]
    return sorted(rows, key=lambda r: r[0] - r[1])


def prompt_streams(tensors: dict, lo: int, hi: int) -> tuple:
    """(token ids, {HF index: stream}) of rows lo..hi-1 of a drafter rank file's tensors (`target_token_ids`,
    `stream.K` = HF hidden_states[K])."""
    by = {int(k.split(".")[1]): v[lo:hi] for k, v in tensors.items() if k.startswith("stream.")}
    return tensors["target_token_ids"][lo:hi], by


def replay_streams(a: dict) -> list:
    """[(token ids, {HF index: stream}, where)] of every captured prompt of 3+ tokens whose streams TP rank 0 kept,
    longest first, for a replay of the draft; [] when there is none. `a`: the report's drafter section
    (tpprobe.engines.vllm.acceptance.analyse: its steps, their folders and requests)."""
    from safetensors.torch import load_file

    found = [(row, lo, hi) for row in a["steps"] if row.get("kept") for lo, hi in prompt_rows(row.get("requests"))]
    found.sort(key=lambda x: x[1] - x[2])
    out, files = [], {}
    for row, lo, hi in found:
        f = str(Path(row["folder"]) / "drafter" / "rank-000.safetensors")
        t = files.get(f)
        if t is None:
            t = files[f] = load_file(f)
        out.append((*prompt_streams(t, lo, hi), f"step {row['step']} ({row['forward_mode']}), prompt rows "
                                               f"{lo}..{hi - 1}"))
    return out
