"""`tpprobe invariance`'s parent process: one launch of N ranks per TP size (the probe's launcher,
tpprobe/probe/launch.py; the ranks run tpprobe/invariance/rank.py), then the comparison and the report.

Run order: the largest TP size first; the modules that issued collectives there ("sites") are
passed to the smaller runs, so tp 1 fingerprints the same modules' outputs.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..core.errors import RankFailure, UsageError
from .compare import compare
from .keep import keep_tensors
from .options import InvarianceOptions, validate
from .render import emit


def run(opts: InvarianceOptions) -> int:
    """Every TP size in turn (the largest first), then the comparison and the report."""
    validate(opts)
    from ..formats.capture_dir import check_out_dir, default_out_dir
    from ..probe.launch import launch_local
    p = opts.probe
    root = Path(p.out or default_out_dir("invariance"))
    check_out_dir(root, 0)
    runs: dict[int, list[dict]] = {}
    t_all = time.time()
    for tp in sorted(opts.tp, reverse=True):
        if not p.quiet and not p.json_out and sys.stderr.isatty():   # scripts get one line per error only
            print(f"tpprobe invariance: tp {tp} ({tp} rank{'s' if tp > 1 else ''}), batch "
                  f"{','.join(map(str, opts.batch))} ...", file=sys.stderr, flush=True)
        d = root / f"tp{tp}"
        d.mkdir(parents=True, exist_ok=True)
        code = launch_local(tp, opts.to_argv(tp, d))
        docs = [_read_rank(d, r) for r in range(tp)]
        errs = [x for x in docs if x is None or "error" in x]
        if code or errs:
            err = next((x for x in errs if x is not None), None)
            if err is not None and err.get("code") == 2:
                raise UsageError(err["error"])
            dead = [r for r, x in enumerate(docs) if x is None]
            why = err["error"] if err else (f"rank(s) {dead} died without a word (killed, or a crash in native "
                                            f"code: their stderr above says where)")
            raise RankFailure(f"the tp {tp} run failed (exit {code}): {why}; its output is in {d}")
        runs[tp] = docs
        if tp > 1 and not opts.sites:     # the modules that issued collectives: tp 1 records their outputs
            opts.sites = list(dict.fromkeys(r["site"] for r in docs[0]["configs"][0]["rows"]
                                            if r["kind"] == "collective"))
    report = compare(runs, opts)
    report["out"] = str(root)
    n_fp = sum(len(doc["configs"][i]["rows"]) for docs in runs.values() for doc in docs for i in range(len(opts.batch)))
    size = sum((root / f"tp{tp}" / f"rank{r}.json").stat().st_size for tp in runs for r in range(tp))
    report["fingerprints"] = {"rank_files_bytes": size, "rows_fingerprinted": n_fp,
                              "bytes_per_row": round(size / max(n_fp, 1))}
    report["timings"] = {"total_s": time.time() - t_all}
    if opts.keep:
        report["kept"] = keep_tensors(root, runs, report, opts)
    else:
        report["kept"] = None
    emit(report, root, opts)
    return report["exit_code"]


def _read_rank(d: Path, r: int) -> Optional[dict]:
    try:
        return json.loads((d / f"rank{r}.json").read_text())
    except (OSError, ValueError):
        return None
