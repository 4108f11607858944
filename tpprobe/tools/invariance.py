"""`tpprobe invariance`: where does bitwise equality across TP sizes and batch sizes break, and
which collective breaks it.

The same prompt runs alone and inside batches of other prompts (packed or padded as the model
batches them: `ProbeTarget.forward_batch`), at every TP size asked for. Each TP size is its own
launch of that many ranks (gloo on CPU, NCCL on GPUs), which runs every batch size in turn under
the probe's Tap. Every capture point (embedding, first layer's input norm, every layer's residual
stream) and every collective (its input on each rank, and the value it produces; at tp 1, where
there is no collective, the output of the module that issues it at tp > 1) is fingerprinted on
the prompt's own token rows only, so a batch never changes the shape compared, and a point costs
a few KB whatever the prompt length. The parent process compares every configuration with the
reference configuration (tp 1 · batch 1 by default) by hash (bitwise) and linear sketch (rounding
noise or material, the probe's noise rule), and names, per configuration, the first row in model
order where bitwise equality breaks and what breaks it:

* a collective whose inputs are bitwise equal on every rank (same TP size) while its output is not:
  the collective itself depends on the message size (an algorithm switch: custom all-reduce vs
  NCCL, channel count, symmetric-memory threshold);
* a collective's output at another TP size: the TP-split reduction (each rank's partial sum over
  its shard, then the collective) adds in another order than the unsplit model;
* anything else: the computation between the last bitwise row and this one (a matmul that
  depends on the number of rows batched, attention over a packed batch, ...).

Run order: the largest TP size first; the modules that issued collectives there ("sites") are
passed to the smaller runs, so tp 1 fingerprints the same modules' outputs.
Files under --out: tp<N>/rank<r>.json (fingerprints), report.json, and with --keep the prompt rows
of every cell that is not bitwise (and the reference's), as safetensors under tensors/.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..capture.points import EMBED_LOCAL, decoder_layer
from ..errors import RankFailure, UsageError

SCHEMA = "tpprobe.invariance/1"
FP_SEED, FP_K = 0x7470, 32          # the probe's sketch seed and size (every run signs alike)
RANK = {"bitwise": 0, "noise": 1, "material": 2, "shape": 3, "missing": 3}
_WRAPPED = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter")


# ---- options ----------------------------------------------------------------------------------
@dataclass
class InvarianceOptions:
    tp: list[int] = field(default_factory=lambda: [1, 2])
    batch: list[int] = field(default_factory=lambda: [1, 3, 8])
    reference: Optional[tuple[int, int]] = None   # (tp, batch); default (smallest tp, smallest batch)
    expect: str = "bitwise"                        # bitwise | noise
    reduce: str = "default"                        # built-in model: default | ordered
    switch_above: Optional[int] = None             # built-in, ordered: backend all-reduce above N bytes
    keep: bool = False
    sites: list[str] = field(default_factory=list)  # rank side: modules whose output stands for a collective
    part: bool = False                             # rank side of one TP size (the launcher passes it)
    probe: Any = None                              # tpprobe.probe.ProbeOptions: the model and run settings

    @property
    def configs(self) -> list[tuple[int, int]]:
        return [(t, b) for t in self.tp for b in self.batch]

    @property
    def ref(self) -> tuple[int, int]:
        return self.reference or (min(self.tp), min(self.batch))


def cname(c) -> str:
    return f"tp{c[0]}·b{c[1]}"


def parse_sizes(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,2,4")
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag} {text!r}: expected comma-separated positive integers like 1,2,4")
    if len(set(vals)) != len(vals):
        raise UsageError(f"{flag} {text!r} repeats a value: give each size once")
    return sorted(vals)


def parse_reference(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    m = re.fullmatch(r"\s*tp\s*(\d+)\s*[,·x/ ]\s*b\s*(\d+)\s*", text)
    if not m:
        raise UsageError(f"--reference {text!r}: expected tpN,bM, e.g. tp1,b1 (TP size 1, batch 1)")
    return int(m.group(1)), int(m.group(2))


def validate(opts: InvarianceOptions) -> None:
    """Everything checkable before a process starts (raises UsageError)."""
    from ..build import validate as probe_validate
    p = opts.probe
    if opts.expect not in ("bitwise", "noise"):
        raise UsageError(f"unknown --expect {opts.expect!r}: use bitwise or noise")
    if opts.ref not in opts.configs:
        raise UsageError(f"--reference {cname(opts.ref)} is not in the grid (--tp {','.join(map(str, opts.tp))} "
                         f"--batch {','.join(map(str, opts.batch))}): add it to --tp/--batch or pick one inside")
    builtin = p.model is None and p.backend != "sglang"
    if (opts.reduce != "default" or opts.switch_above is not None) and not builtin:
        raise UsageError("--reduce / --switch-above choose the built-in model's reduction: drop them with "
                         "--model or --backend sglang")
    if opts.switch_above is not None and opts.reduce != "ordered":
        raise UsageError("--switch-above N makes the ordered reduction fall back to the backend's all-reduce above "
                         "N bytes: use it with --reduce ordered")
    if opts.switch_above is not None and opts.switch_above < 0:
        raise UsageError(f"--switch-above must be >= 0 bytes (got {opts.switch_above})")
    for t in opts.tp:
        probe_validate(p, t)
        if builtin:
            _builtin_cfg(opts, p.layers).validate(t)
        elif p.backend == "sglang":      # the shapes' own rule, as the probe checks it (before any rank starts)
            from ..sglang.tiny import check_tp
            check_tp(p.arch, p.config, t)
    if p.tokens < 1:
        raise UsageError(f"--tokens must be >= 1 (got {p.tokens})")
    if len(opts.configs) < 2:
        raise UsageError(f"nothing to compare: --tp {','.join(map(str, opts.tp))} --batch "
                         f"{','.join(map(str, opts.batch))} is one configuration; give two TP sizes or batch sizes")


def _builtin_cfg(opts: InvarianceOptions, layer_ids):
    from ..model import BuiltinConfig
    cfg = BuiltinConfig.from_options(opts.probe, layer_ids)
    cfg.reduce, cfg.switch_bytes = opts.reduce, opts.switch_above
    return cfg


# ---- the batch ---------------------------------------------------------------------------------
def make_batch(prompt: torch.Tensor, batch: int, vocab: int, seed: int) -> tuple[list[torch.Tensor], int]:
    """The prompt inside `batch` prompts: the others are seeded random ids of other lengths (half to
    twice the prompt's); the prompt sits in the middle, so it is neither first nor last in the rows."""
    n = int(prompt.numel())
    g = torch.Generator().manual_seed(seed + 7919)
    others = []
    for _ in range(batch - 1):
        m = int(torch.randint(max(1, n // 2), 2 * n + 1, (1,), generator=g))
        others.append(torch.randint(0, max(vocab, 1), (m,), generator=g).to(prompt.dtype))
    idx = (batch - 1) // 2
    seqs = others[:idx] + [prompt.cpu()] + others[idx:]
    return [s.to(prompt.device) for s in seqs], idx


class RowSelector:
    """The prompt's own token rows of a captured activation."""

    def __init__(self, layout: str, lens: list[int], idx: int):
        self.layout, self.lens, self.idx = layout, lens, idx
        self.off, self.n, self.total = sum(lens[:idx]), lens[idx], sum(lens)

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(rows, per_token): per_token False when the tensor is not laid out by token."""
        if self.layout == "padded":
            if t.dim() >= 2 and t.shape[0] == len(self.lens) and t.shape[1] == max(self.lens):
                return t[self.idx, :self.n], True
            if len(self.lens) == 1 and t.dim() >= 1 and t.shape[0] == self.n:
                return t, True
        elif t.dim() >= 1 and t.shape[0] == self.total:
            return t[self.off:self.off + self.n], True
        return t, False


# ---- the rank side -----------------------------------------------------------------------------
@dataclass
class _Cap:
    fp: Any
    per_token: bool
    tid: Optional[int] = None       # index into _Recorder.tensors (--keep)


class _Recorder:
    """What one configuration's forward produced, in firing order: capture points (from the Tap),
    collectives (the Tap's all-reduce audit, and the gathers / reduce-scatters wrapped here), and
    the outputs of the modules that issue collectives."""

    def __init__(self, select: RowSelector, keep: bool, sites: list[str]):
        self.select, self.keep, self.sites = select, keep, set(sites)
        self.tensors: list[torch.Tensor] = []
        self.events: list[tuple] = []          # (tap position, kind, payload)
        self.pending: set[str] = set()         # modules whose output closes a non-all-reduce collective
        self.tap = None

    def summarize(self, t: torch.Tensor) -> _Cap:
        from ..exchange.fingerprint import fingerprint
        rows, per_token = self.select(t.detach())
        cap = _Cap(fingerprint(rows.contiguous(), seed=FP_SEED, k=FP_K), per_token)
        if self.keep:
            cap.tid = len(self.tensors)
            self.tensors.append(rows.detach().to("cpu").clone())
        return cap

    # a Tap extension: collectives the Tap does not audit, all-reduce positions, site outputs
    def extension(self, tap) -> list:
        self.tap = tap
        undo = []
        # all-reduces: the Tap's collective audit records them (capture/audit.py); note where in the
        # capture order each one began (its summaries are filled in when it ends)
        audit = tap.auditor
        begin = audit.begin

        def noted(kind, path, inp, group_size, op="SUM", checked=True):
            pos = len(tap.order)
            r = begin(kind, path, inp, group_size, op, checked)
            if kind == "all_reduce":
                self.events.append((pos, "allreduce", r))
            return r
        audit.begin = noted
        undo.append(_Undo(lambda: audit.__dict__.pop("begin", None)))
        for mod in (dist, c10d):
            for name in _WRAPPED:
                orig = getattr(mod, name, None)
                if orig is None:
                    continue
                setattr(mod, name, self._wrap(name, orig))
                undo.append(_Undo(lambda m=mod, n=name, o=orig: setattr(m, n, o)))
        for mname, m in tap.model.named_modules():
            if mname:
                undo.append(m.register_forward_hook(lambda mod, a, out, _n=mname: self._module_out(_n, out)))
        return undo

    def _wrap(self, op: str, orig):
        def wrapped(*args, **kw):
            t = _collective_input(op, args, kw)
            if t is None:
                return orig(*args, **kw)
            module, layer, where, source = self.tap._attribution(t)
            site = source or module
            info = {"op": op, "site": site, "module": module, "layer": layer, "where": where,
                    "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                    "bytes": t.numel() * t.element_size(), "in": self.summarize(t)}
            self.events.append((len(self.tap.order), "collective", info))
            self.pending.add(site)
            return orig(*args, **kw)
        return wrapped

    def _module_out(self, name: str, out) -> None:
        if name not in self.pending and name not in self.sites:
            return
        t = _first_tensor(out)
        if t is None or not t.dtype.is_floating_point:
            return
        self.pending.discard(name)
        self.events.append((len(self.tap.order), "site_out", {"site": name, "out": self.summarize(t)}))


class _Undo:
    def __init__(self, fn):
        self.fn = fn

    def remove(self):
        if self.fn is not None:
            self.fn, fn = None, self.fn
            fn()


def _first_tensor(x):
    from ..capture.hooks import first_tensor
    return first_tensor(x)


def _collective_input(op: str, args, kw) -> Optional[torch.Tensor]:
    """The tensor this rank sends (all_gather(_into_tensor): the input; reduce_scatter: the input)."""
    if op in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
        t = args[1] if len(args) > 1 else kw.get("input") or kw.get("input_tensor")
    elif op == "all_gather":
        t = args[1] if len(args) > 1 else kw.get("tensor")
    else:   # reduce_scatter(output, input_list)
        lst = args[1] if len(args) > 1 else kw.get("input_list")
        t = torch.cat([x.reshape(-1) for x in lst]) if lst else None
    return t if isinstance(t, torch.Tensor) else None


def _rows(rec: _Recorder, tap, world: int) -> list[dict]:
    """The recorder's events and the Tap's points, merged in firing order, as comparable rows."""
    evs_at: dict[int, list] = {}
    for pos, kind, payload in rec.events:
        evs_at.setdefault(pos, []).append((kind, payload))
    rows: list[dict] = []
    count: dict[str, int] = {}
    open_coll: dict[str, dict] = {}

    def key_for(site: str) -> str:
        k = count.get(site, 0)
        count[site] = k + 1
        return site if k == 0 else f"{site}#{k}"

    def emit_events(pos):
        for kind, p in evs_at.get(pos, []):
            if kind == "allreduce":
                if p is None or world == 1:
                    continue
                site = p.source or p.module
                rows.append({"key": key_for(site), "kind": "collective", "op": "all_reduce", "site": site,
                             "module": p.module, "layer": p.layer, "seq": p.seq, "shape": list(p.shape),
                             "dtype": p.dtype, "bytes": _nbytes(p.shape, p.dtype),
                             "in": p.inp_summary, "out": p.out_summary})
            elif kind == "collective":
                site = p["site"]
                row = {"key": key_for(site), "kind": "collective", **{k: v for k, v in p.items() if k != "in"},
                       "in": p["in"], "out": None}
                rows.append(row)
                open_coll[site] = row
            elif kind == "site_out":
                site = p["site"]
                if site in open_coll:                  # the value the gather-based collective produced
                    open_coll.pop(site)["out"] = p["out"]
                elif world == 1 and site in rec.sites:  # tp 1: the module's output stands for the collective
                    rows.append({"key": key_for(site), "kind": "collective", "op": None, "site": site,
                                 "module": site, "layer": _site_layer(site), "in": None, "out": p["out"]})

    order = list(tap.order)
    for i, name in enumerate(order):
        emit_events(i)
        if name == EMBED_LOCAL:               # the embedding's all-reduce input: a shard, in its row
            continue
        cap = tap.summaries.get(name)
        if cap is not None:
            rows.append({"key": name, "kind": "point", "layer": decoder_layer(name), "out": cap})
    emit_events(len(order))
    return rows


def _site_layer(site: str) -> Optional[int]:
    """The decoder layer of a module path (model.layers.3.mlp.down_proj: 3); None outside the layers."""
    m = re.search(r"(?:^|\.)(?:layers|layer)\.(\d+)(?:\.|$|#)", site)
    return int(m.group(1)) if m else None


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _cap_json(cap: Optional[_Cap], keep_ids: dict, key: str) -> Optional[dict]:
    if cap is None:
        return None
    d = {"fp": cap.fp.to_json(), "per_token": cap.per_token}
    if cap.tid is not None:
        keep_ids[key] = cap.tid
    return d


def run_config(target, batch: int, opts: InvarianceOptions, world: int) -> tuple[dict, dict]:
    """One forward of the prompt inside `batch` prompts under the Tap; its rows (JSON) and, with
    --keep, the prompt rows of every fingerprinted tensor."""
    from ..capture.hooks import Tap
    p = opts.probe
    vocab = int(target.info.get("vocab") or (int(target.input_ids.max()) + 1))
    seqs, idx = make_batch(target.input_ids, batch, vocab, p.seed)
    lens = [int(s.numel()) for s in seqs]
    rec = _Recorder(RowSelector(target.batch_layout if target.forward_batch else "packed", lens, idx),
                    opts.keep, opts.sites)
    t0 = time.time()
    # the batch's ids are not target.input_ids: the embedding is the first module taking integer ids
    with torch.no_grad(), Tap(target.model, embed=p.embed or target.embed, layers=p.layer_list or target.layer_list,
                              keep=lambda n: False, keep_allreduce_tensors=False, summarize=rec.summarize,
                              extensions=(*target.tap_extensions, rec.extension)) as tap:
        tap.stream_from_layer_output = target.stream_from_layer_output
        if target.forward_batch is not None:
            target.forward_batch(seqs)
        else:
            target.forward()
    seconds = time.time() - t0
    rows = _rows(rec, tap, world)
    keep_ids: dict[str, int] = {}
    out_rows = []
    for r in rows:
        j = {k: v for k, v in r.items() if k not in ("in", "out")}
        j["in"] = _cap_json(r.get("in"), keep_ids, f"{r['key']}|in")
        j["out"] = _cap_json(r.get("out"), keep_ids, f"{r['key']}|out")
        out_rows.append(j)
    tensors = {k: rec.tensors[i] for k, i in keep_ids.items()}
    return {"batch": batch, "lens": lens, "prompt_index": idx, "prompt_rows": [sum(lens[:idx]), lens[idx]],
            "forward_s": seconds, "rows": out_rows}, tensors


def build(ctx, opts: InvarianceOptions):
    from ..build import build_target
    p = opts.probe
    if p.model is None and p.backend != "sglang":
        from ..model import build_builtin
        return build_builtin(ctx, _builtin_cfg(opts, p.layers))
    return build_target(ctx, p, [] if p.backend == "sglang" else p.layers)


def rank_main(opts: InvarianceOptions) -> int:
    """One rank of one TP size: every batch size in turn; writes tp<N>/rank<r>.json."""
    from ..exchange.dist import init
    p = opts.probe
    out = Path(p.out)
    import faulthandler
    faulthandler.enable()       # a rank that dies in native code (NCCL, a kernel) still says where
    rank = int(os.environ.get("RANK", "0"))
    code, ctx = 0, None
    try:
        # inside the try: a rank whose process group cannot start writes why (never "wrote nothing")
        ctx = init(None if p.backend in ("auto", "sglang") else p.backend, p.timeout, p.seed)
        if ctx.world_size not in opts.tp or len(opts.tp) != 1:
            raise UsageError("the rank side runs one TP size: --tp N with N = the number of ranks")
        target = build(ctx, opts)
        if target.forward_batch is None and max(opts.batch) > 1:
            raise UsageError(f"--model {p.model}: its ProbeTarget has no forward_batch, so it runs one prompt "
                             f"at a time: use --batch 1, or give it forward_batch (docs/invariance.md)")
        configs, kept = [], {}
        for b in opts.batch:
            cfg, tensors = run_config(target, b, opts, ctx.world_size)
            configs.append(cfg)
            kept.update({f"b{b}|{k}": v for k, v in tensors.items()})
        doc = {"tp": ctx.world_size, "rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
               "arch": target.arch, "dtype": str(target.dtype).replace("torch.", ""),
               "tokens": int(target.input_ids.numel()), "hidden": target.hidden_size,
               "layout": target.batch_layout if target.forward_batch else "single",
               "info": {k: v for k, v in target.info.items() if isinstance(v, (int, float, str))},
               "configs": configs}
        if kept:
            from ..capture.files import atomic_save_tensors
            atomic_save_tensors(out / f"rank{ctx.rank}.safetensors", {k: v.contiguous() for k, v in kept.items()}, {})
    except UsageError as e:
        doc, code = {"tp": opts.tp[0], "rank": rank, "error": str(e), "code": 2}, 2
    except Exception as e:   # a bug or a broken model on this rank: its traceback, then a one-line cause
        import traceback
        traceback.print_exc()
        doc, code = {"tp": opts.tp[0], "rank": rank, "code": 1,
                     "error": f"rank {rank} of tp {opts.tp[0]} failed"
                              f"{'' if ctx else ' to start its process group'}: {type(e).__name__}: {e}"}, 1
    from ..capture.files import atomic_write_bytes
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / f"rank{rank}.json", json.dumps(doc).encode())
    try:
        if ctx is not None and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return code


# ---- the parent: launch, compare, report -------------------------------------------------------
def rank_argv(opts: InvarianceOptions, tp: int, out: Path) -> list[str]:
    """The command line one TP size's ranks run (`python -m tpprobe invariance --part ...`)."""
    p = opts.probe
    a = ["invariance", "--part", "--tp", str(tp), "--batch", ",".join(map(str, opts.batch)), "--reduce", opts.reduce,
         "--num-layers", str(p.num_layers), "--hidden", str(p.hidden), "--heads", str(p.heads), "--ffn", str(p.ffn),
         "--vocab", str(p.vocab), "--tokens", str(p.tokens), "--seed", str(p.seed), "--dtype", p.dtype,
         "--backend", p.backend, "--arch", p.arch, "--timeout", str(p.timeout), "--out", str(out), "--quiet"]
    for flag, v in (("--switch-above", opts.switch_above), ("--model", p.model), ("--config", p.config)):
        if v is not None:
            a += [flag, str(v)]
    if opts.keep:
        a.append("--keep")
    if opts.sites and tp == 1:
        a += ["--sites", ",".join(opts.sites)]
    if p.debug:
        a.append("--debug")
    return a


def run(opts: InvarianceOptions) -> int:
    validate(opts)
    from ..capture.files import check_out_dir, default_out_dir
    from ..launch import launch_local
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
        code = launch_local(tp, rank_argv(opts, tp, d))
        docs = [_read_rank(d, r) for r in range(tp)]
        errs = [x for x in docs if x is None or "error" in x]
        if code or errs:
            err = next((x for x in errs if x is not None), None)
            if err is not None and err.get("code") == 2:
                raise UsageError(err["error"])
            why = err["error"] if err else (f"rank(s) {[r for r, x in enumerate(docs) if x is None]} died without "
                                            f"a word (killed, or a crash in native code: their stderr above says where)")
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
        report["kept"] = _keep_tensors(root, runs, report, opts)
    else:
        report["kept"] = None
    emit(report, root, opts)
    return report["exit_code"]


def _read_rank(d: Path, r: int) -> Optional[dict]:
    try:
        return json.loads((d / f"rank{r}.json").read_text())
    except (OSError, ValueError):
        return None


# ---- comparison --------------------------------------------------------------------------------
def _fp(cell: Optional[dict]):
    from ..exchange.fingerprint import Fingerprint
    return None if cell is None else Fingerprint.from_json(cell["fp"])


def _level(a: Optional[dict], b: Optional[dict]) -> dict:
    """a against b (cells of two configurations): level and the sketch's relative difference."""
    from ..checks.evidence import fp_dtype, fp_level, fp_rel, judge_dtype
    if a is None or b is None:
        return {"level": "missing"}
    fa, fb = _fp(a), _fp(b)
    if not (a.get("per_token", True) and b.get("per_token", True)) and fa.shape != fb.shape:
        return {"level": "n/a", "why": "not laid out by token: its shape follows the batch"}
    lv = fp_level(fa, fb, judge_dtype(fp_dtype(fa), fp_dtype(fb), fp_dtype(fb)))
    out = {"level": lv}
    if lv in ("noise", "material"):
        out["rel"] = fp_rel(fa, fb)
    return out


def _worst(cells: list[dict]) -> dict:
    cells = [c for c in cells if c["level"] in RANK]
    return max(cells, key=lambda c: RANK[c["level"]]) if cells else {"level": "n/a"}


def _merge_order(lists: list[list[str]]) -> list[str]:
    """Keys of every configuration in one model order (each list is in firing order)."""
    merged: list[str] = []
    for keys in sorted(lists, key=len, reverse=True):   # stable: equal lengths keep the callers' order
        prev = None
        for k in keys:
            if k not in merged:
                merged.insert(merged.index(prev) + 1 if prev is not None else 0, k)
            prev = k
    return merged


def compare(runs: dict[int, list[dict]], opts: InvarianceOptions) -> dict:
    from .. import __version__
    R = opts.ref
    bidx = {b: i for i, b in enumerate(opts.batch)}

    def rows_of(c, rank=0) -> dict:
        return {r["key"]: r for r in runs[c[0]][rank]["configs"][bidx[c[1]]]["rows"]}

    rows = {c: [rows_of(c, r) for r in range(c[0])] for c in opts.configs}
    # the largest TP size first: its collectives fire inside the modules, tp 1's outputs after them
    order = _merge_order([[r["key"] for r in runs[c[0]][0]["configs"][bidx[c[1]]]["rows"]]
                          for c in sorted(opts.configs, key=lambda c: -c[0])])
    table = []
    for key in order:
        any_row = next(rs[0][key] for rs in rows.values() if key in rs[0])
        is_coll = any_row["kind"] == "collective"
        ops = {c: rows[c][0][key].get("op") for c in opts.configs if key in rows[c][0]}
        entry = {"key": key, "kind": any_row["kind"], "layer": any_row.get("layer"),
                 "site": any_row.get("site"), "ops": {cname(c): o for c, o in ops.items()},
                 "bytes": {cname(c): rows[c][0][key].get("bytes") for c in opts.configs if key in rows[c][0]},
                 "cells": {}, "in_cells": {} if is_coll else None}
        for c in opts.configs:
            entry["cells"][cname(c)] = _out_cell(c, R, key, rows)
            if is_coll:
                entry["in_cells"][cname(c)] = _in_cell(c, R, key, rows)
        ref_row = rows[R][0].get(key) or any_row
        entry["dtype"] = ((ref_row.get("out") or {}).get("fp") or {}).get("dtype")
        table.append(entry)
    for c in opts.configs:
        if c != R:
            _propagated(table, cname(c), cname(R))
    configs = []
    for c in opts.configs:
        cells = [e["cells"][cname(c)] for e in table]
        cells += [e["in_cells"][cname(c)] for e in table if e["in_cells"] and e["in_cells"][cname(c)].get("vs") == cname(R)]
        worst = "reference" if c == R else _worst(cells)["level"]
        doc = runs[c[0]][0]["configs"][bidx[c[1]]]
        configs.append({"name": cname(c), "tp": c[0], "batch": c[1], "level": worst, "lens": doc["lens"],
                        "prompt_index": doc["prompt_index"], "prompt_rows": doc["prompt_rows"],
                        "forward_s": doc["forward_s"],
                        "first_break": None if c == R else _first_break(c, R, table, rows, opts)})
    ok_levels = ("bitwise",) if opts.expect == "bitwise" else ("bitwise", "noise")
    failing = [x for x in configs if x["level"] not in ok_levels and x["level"] != "reference"]
    n_rows = len(table)
    first = runs[max(runs)][0]
    settings = {**{f"model {k}" if k in ("model", "backend") else k: v for k, v in first["info"].items()},
                "model": _model_name(opts), "backend": first["backend"], "device": first["device"],
                "dtype": first["dtype"], "arch": first["arch"], "tokens": first["tokens"], "hidden": first["hidden"],
                "layout": first["layout"], "tp": opts.tp, "batch": opts.batch, "reference": cname(R),
                "expect": opts.expect, "reduce": opts.reduce, "switch_above": opts.switch_above,
                "seed": opts.probe.seed, "fingerprint": {"seed": FP_SEED, "k": FP_K}}
    verdict = _verdict(configs, R, n_rows, opts, failing)
    from ..report.envinfo import environment
    return {"schema": SCHEMA, "tool": f"tpprobe {__version__}", "settings": settings,
            "environment": environment(), "configs": configs, "rows": table, "verdict": verdict,
            "exit_code": 1 if failing or n_rows == 0 else 0}


def _out_cell(c, R, key, rows) -> dict:
    if c == R:
        return {"level": "reference"}
    ref = rows[R][0].get(key)
    mine = [rs.get(key) for rs in rows[c]]
    if ref is None:
        if mine[0] is None:
            return {"level": "n/a", "why": "not in this configuration"}
        return {"level": "n/a", "why": f"not in the reference {cname(R)}"}
    if mine[0] is None:
        return {"level": "missing", "why": f"{cname(R)} has it, this configuration does not"}
    per_rank = [_level(m["out"] if m else None, ref["out"]) for m in mine]
    cell = dict(_worst(per_rank))
    bad = [r for r, x in enumerate(per_rank) if x["level"] != "bitwise"]
    if bad and len(mine) > 1:
        cell["ranks"] = bad
    return cell


def _propagated(table: list[dict], n: str, rname: str) -> None:
    """Downstream of the first break, rounding differences propagate and add up: a cell whose sketch
    difference exceeds the probe's noise bound for one operation (checks/noise.py rel_bound, as
    checks.evidence.fp_level judges a sketch) but stays within that bound * (layers since the first break + 1) -- each layer
    re-rounds and passes on what it got (measured: fp32, 6 layers, tp 4: 2.4x the one-operation bound
    five layers on) -- is rounding noise that propagated, not a new break. A jump beyond it (a missing
    shard: ~0.5; a 1 % error in float32) stays material. The first break itself is always judged by
    the one-operation bound.
    Cells against the reference count from the first break against the reference; collective inputs
    compared with the same TP size at the reference's batch count from the first difference either way."""
    from ..checks.noise import dtype_from_str, rel_bound
    last_layer = max((e["layer"] for e in table if e.get("layer") is not None), default=0)

    def cells_of(e):
        out = [("ref", e["cells"][n])]
        if e["in_cells"]:
            ic = e["in_cells"][n]
            out.append(("ref" if ic.get("vs") == rname else "sib", ic))
        return out
    first: dict[str, Optional[int]] = {"ref": None, "sib": None}
    for e in table:
        layer = e["layer"] if e.get("layer") is not None else (0 if first["ref"] is None else last_layer)
        for side, cell in cells_of(e):
            start = first["ref"] if side == "ref" else min((x for x in first.values() if x is not None), default=None)
            if start is None:
                if cell["level"] not in ("bitwise", "n/a", "reference"):
                    first[side] = layer
                continue
            if cell["level"] != "material" or cell.get("rel") is None or not e.get("dtype"):
                continue
            dt = dtype_from_str(e["dtype"])
            bound = rel_bound(dt) * (max(layer - start, 0) + 1)
            if cell["rel"] <= bound:
                cell.update(level="noise", propagated=True, bound=bound)


def _in_cell(c, R, key, rows) -> dict:
    """A collective's input on each rank: against the same rank of the reference when the TP size is
    the reference's, else against the same TP size at the reference's batch (its own sibling)."""
    vs = R if c[0] == R[0] else (c[0], R[1])
    if c == vs:
        return {"level": "reference" if c == R else "n/a",
                "why": "" if c == R else f"inputs are rank shards: no counterpart at tp {R[0]}"}
    if vs not in rows:
        return {"level": "n/a", "why": f"{cname(vs)} was not run"}
    per_rank = []
    for r in range(c[0]):
        a, b = rows[c][r].get(key), rows[vs][r].get(key)
        if a is None or b is None or a.get("in") is None or b.get("in") is None:
            return {"level": "n/a", "why": "no collective input here", "vs": cname(vs)}
        per_rank.append(_level(a["in"], b["in"]))
    cell = dict(_worst(per_rank), vs=cname(vs))
    bad = [r for r, x in enumerate(per_rank) if x["level"] != "bitwise"]
    if bad:
        cell["ranks"] = bad
    return cell


def _coll(row: Optional[dict]) -> Optional[dict]:
    if not row or row.get("kind") != "collective":
        return None
    return {k: row.get(k) for k in ("op", "site", "module", "layer", "seq", "shape", "dtype", "bytes")}


def human_bytes(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _coll_text(col: Optional[dict]) -> str:
    if not col or not col.get("op"):
        return "no collective (tp 1)"
    shape = "×".join(map(str, col.get("shape") or []))
    return f"{col['op']} of {human_bytes(col.get('bytes'))} ({shape} {col.get('dtype')})"


def _first_break(c, R, table, rows, opts) -> Optional[dict]:
    prev = None
    for e in table:
        cell = e["cells"][cname(c)]
        inc = e["in_cells"][cname(c)] if e["in_cells"] else None
        if inc and inc.get("vs") == cname(R) and inc["level"] not in ("bitwise", "n/a", "reference"):
            return _blame_compute(c, R, e, inc, prev, rows, where="input")
        if cell["level"] in ("bitwise", "n/a", "reference"):
            if cell["level"] == "bitwise":
                prev = e
            continue
        if e["kind"] == "collective":
            return _blame_collective(c, R, e, cell, prev, rows, opts)
        return _blame_compute(c, R, e, cell, prev, rows, where="point")
    return None


def _label(e: Optional[dict]) -> str:
    if e is None:
        return "the input ids"
    return f"{e['key']} ({'collective output' if e['kind'] == 'collective' else 'capture point'})"


def _brk(c, e, cell, cause, summary, col=None, ref_col=None, vs=None) -> dict:
    """summary: what breaks, in words that hold for every configuration it breaks the same way;
    line: the same for this configuration, with its level and message size."""
    lvl = cell["level"] + (f" (rel {cell['rel']:.1e})" if cell.get("rel") is not None else "")
    size = f"; {_coll_text(col)}" + (f", {_coll_text(ref_col)} in {vs}" if ref_col and ref_col.get("op") else "") \
        if col else ""
    return {"row": e["key"], "kind": e["kind"], "layer": e.get("layer"), "level": cell["level"],
            "rel": cell.get("rel"), "ranks": cell.get("ranks"), "cause": cause, "collective": col,
            "compared_collective": ref_col, "vs": vs, "summary": summary,
            "line": f"{cname(c)}: {summary}: {lvl}{size}."}


def _where(e) -> str:
    return f"layer {e['layer']}" if e.get("layer") is not None else "outside the decoder layers"


def _blame_collective(c, R, e, cell, prev, rows, opts) -> dict:
    key = e["key"]
    mine, ref = rows[c][0].get(key), rows[R][0].get(key)
    col = _coll(mine)
    # the same TP size at the reference's batch: equal inputs on every rank, unequal output = the collective
    sib = R if c[0] == R[0] else (c[0], R[1])
    if sib != c and sib in rows and key in rows[sib][0]:
        inputs_equal = all(
            rows[c][r].get(key) and rows[sib][r].get(key) and rows[c][r][key].get("in") and rows[sib][r][key].get("in")
            and _level(rows[c][r][key]["in"], rows[sib][r][key]["in"])["level"] == "bitwise" for r in range(c[0]))
        out_differs = _level(mine["out"], rows[sib][0][key]["out"])["level"] != "bitwise"
        if inputs_equal and out_differs:
            sc = _coll(rows[sib][0][key])
            switched = bool(sc and col and sc.get("op") != col.get("op"))
            summary = (f"bitwise equality breaks at the collective of {e['site']} ({_where(e)}): its inputs are "
                       f"bitwise equal on every rank to the same TP size at batch {sib[1]}, its output is not, so the "
                       f"collective's result depends on its message size"
                       + (" (it switched algorithm)" if switched else ""))
            return _brk(c, e, cell, "collective-size", summary, col, sc, cname(sib))
    if c[0] != R[0]:
        rc = _coll(ref)
        summary = (f"bitwise equality breaks at the collective of {e['site']} ({_where(e)}): the TP-split reduction "
                   f"(a partial sum per rank shard, then the collective) adds in another order than {cname(R)}"
                   + ("" if rc and rc.get("op") else " (no collective there: the contraction is not split)"))
        return _brk(c, e, cell, "tp-split", summary, col, rc, cname(R))
    summary = (f"bitwise equality breaks at the output of {e['site']} ({_where(e)}): its collective's inputs "
               f"already differ, so the computation between {_label(prev)} and it does")
    return _brk(c, e, cell, "compute", summary, col, _coll(ref), cname(R))


def _blame_compute(c, R, e, cell, prev, rows, where) -> dict:
    what = f"the input of the collective of {e['site']}" if where == "input" else e["key"]
    summary = (f"bitwise equality breaks at {what} ({_where(e)}) while {_label(prev)} is still bitwise: the "
               f"computation in between (no collective) depends on the batch or the TP size")
    col = _coll(rows[c][0].get(e["key"])) if e["kind"] == "collective" else None
    return _brk(c, e, cell, "compute", summary, col, None, cname(R))


def _verdict(configs, R, n_rows, opts, failing) -> dict:
    others = [x for x in configs if x["level"] != "reference"]
    if n_rows == 0:
        return {"status": "empty", "line": "NOTHING COMPARED: no capture point or collective was recorded", "lines": []}
    levels = {x["level"] for x in others}
    n_bit = sum(x["level"] == "bitwise" for x in others)
    grid = f"tp {','.join(map(str, opts.tp))} × batch {','.join(map(str, opts.batch))}"
    if levels == {"bitwise"}:
        head = (f"BITWISE: all {len(others)} configurations ({grid}) are bitwise equal to {cname(R)} "
                f"at every one of the {n_rows} capture points and collectives")
        status = "bitwise"
    else:
        worst = max(levels, key=lambda lv: RANK.get(lv, 0))
        word = {"noise": "within rounding noise", "material": "MATERIALLY", "shape": "in SHAPE",
                "missing": "in COVERAGE (rows missing)"}.get(worst, worst)
        head = (f"NOT BITWISE: {len(others) - n_bit} of {len(others)} configurations ({grid}) differ from "
                f"{cname(R)}, worst {word}")
        status = worst
    groups: dict[str, list] = {}          # configurations that break the same way: one line
    for x in others:
        if x["first_break"]:
            groups.setdefault(x["first_break"]["summary"], []).append(x)
    lines = []
    for summary, xs in groups.items():
        per = []
        for x in xs:
            fb = x["first_break"]
            lv = fb["level"] + (f" {fb['rel']:.1e}" if fb.get("rel") is not None else "")
            col = fb.get("collective")
            per.append(f"{x['name']} {lv}" + (f", {col['op']} {human_bytes(col.get('bytes'))}"
                                              if col and col.get("op") else ""))
            cc = fb.get("compared_collective")
            if fb["cause"] == "collective-size" and cc and cc.get("op"):
                per[-1] += f" (vs {cc['op']} {human_bytes(cc.get('bytes'))} in {fb['vs']})"
        lines.append(f"{', '.join(x['name'] for x in xs)}: {summary} [{'; '.join(per)}]")
    exp = (f"--expect {opts.expect}: " + ("met" if not failing else
                                          f"NOT met by {', '.join(x['name'] for x in failing)}"))
    return {"status": status, "line": head, "lines": lines, "expect": exp}


def _model_name(opts) -> str:
    p = opts.probe
    if p.model:
        return p.model
    if p.backend == "sglang":
        return f"sglang:{p.arch}"
    return "builtin" + (f" (reduce {opts.reduce}" + (f", switch above {opts.switch_above} B" if opts.switch_above
                                                     is not None else "") + ")" if opts.reduce != "default" else "")


# ---- --keep: full tensors only where a cell is not bitwise -------------------------------------
def _keep_tensors(root: Path, runs, report, opts) -> dict:
    """Rewrite each rank's tensors to the cells that are not bitwise (plus the reference's
    counterparts), with exact statistics from the tensors; delete the rest."""
    from safetensors.torch import load_file
    from ..capture.files import atomic_save_tensors
    from ..checks.noise import compare as tcompare
    R = opts.ref
    raw = {}
    for tp in runs:
        for r in range(tp):
            f = root / f"tp{tp}" / f"rank{r}.safetensors"
            raw[(tp, r)] = load_file(str(f)) if f.exists() else {}
    needed: dict[tuple[int, int], set] = {}
    n_cells = 0
    for e in report["rows"]:
        for c in opts.configs:
            for side, cells in (("out", e["cells"]), ("in", e["in_cells"] or {})):
                cell = cells.get(cname(c))
                if not cell or cell["level"] in ("bitwise", "reference", "n/a", "missing"):
                    continue
                vs = R if side == "out" else _cfg_of(cell.get("vs"), R)
                k = f"{e['key']}|{side}"
                ranks = range(c[0]) if side == "in" else [0]
                for r in ranks:
                    a, b = raw[(c[0], r)].get(f"b{c[1]}|{k}"), raw[(vs[0], r)].get(f"b{vs[1]}|{k}")
                    if a is None or b is None:
                        continue
                    needed.setdefault((c[0], r), set()).add(f"b{c[1]}|{k}")
                    needed.setdefault((vs[0], r), set()).add(f"b{vs[1]}|{k}")
                    if r == (cell.get("ranks") or [0])[0] or side == "out":
                        st = tcompare(a, b)
                        cell.update({x: st[x] for x in ("max_abs", "ulp_max", "first_token") if x in st})
                n_cells += 1
    files = []
    tdir = root / "tensors"
    tdir.mkdir(parents=True, exist_ok=True)
    for (tp, r), ts in raw.items():
        keep = {k: v for k, v in ts.items() if k in needed.get((tp, r), set())}
        if keep:
            dst = tdir / f"tp{tp}-rank{r}.safetensors"
            atomic_save_tensors(dst, {k.replace("|", "/"): v for k, v in keep.items()}, {})
            files.append(str(dst))
        f = root / f"tp{tp}" / f"rank{r}.safetensors"
        if f.exists():
            f.unlink()
    return {"cells": n_cells, "files": files}


def _cfg_of(name: Optional[str], default):
    m = re.fullmatch(r"tp(\d+)·b(\d+)", name or "")
    return (int(m.group(1)), int(m.group(2))) if m else default


# ---- output --------------------------------------------------------------------------------------
COMPACT = {"bitwise": "=", "noise": "≈", "material": "✗", "shape": "✗ shape", "missing": "✗ missing"}
LEVEL_STYLE = {"bitwise": "green", "reference": "cyan", "noise": "yellow", "material": "bold red",
               "shape": "bold red", "missing": "bold red", "n/a": "dim"}


def cell_text(cell: dict, short: bool = False) -> str:
    """short (the terminal): noise without its number (the verdict gives the first break's)."""
    lv = cell.get("level", "?")
    if lv == "reference":
        return "ref"
    if lv == "n/a":
        return "·"
    if lv == "noise" and short:
        return "noise"
    if lv in ("noise", "material") and cell.get("rel") is not None:
        m, ex = f"{cell['rel']:.0e}".split("e")
        return f"{lv} {m}e{int(ex)}"
    return lv


def row_label(e: dict) -> str:
    return f"⇄ {e['key']}" if e["kind"] == "collective" else e["key"]


def render(report: dict, con) -> None:
    from rich.table import Table
    from rich.text import Text
    st = report["settings"]
    con.rule(f"[bold]tpprobe invariance[/] — {st['model']} · {st['backend']} · {st['dtype']} · "
             f"reference {st['reference']} · expect {st['expect']}")
    t = Table(title="capture points and collectives (model order) × configurations", title_justify="left",
              show_lines=False, pad_edge=False)
    t.add_column("point / collective", no_wrap=True)
    names = [x["name"] for x in report["configs"]]
    for n in names:
        t.add_column(n)
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    # too wide for the terminal: one symbol per level (the legend says which)
    def col_width(n):       # its widest cell (the first break's carries " ◀") + padding and border
        w = [len(n)] + [len(cell_text(e["cells"][n], short=True)) + (2 if firsts[n] == e["key"] else 0)
                        for e in report["rows"]]
        w += [len(cell_text(e["in_cells"][n], short=True)) for e in report["rows"] if e["in_cells"]]
        return max(w) + 3
    width = max((len(row_label(e)) for e in report["rows"]), default=20) + sum(col_width(n) for n in names)
    compact = width > (con.width or 120)

    def text(c, key=None):
        lv = c["level"]
        txt = COMPACT.get(lv, lv) if compact and lv in COMPACT else cell_text(c, short=True)
        return Text(txt + (" ◀" if key is not None and firsts[n] == key else ""), style=LEVEL_STYLE.get(lv, ""))
    for e in report["rows"]:
        cells = []
        for n in names:
            cells.append(text(e["cells"][n], e["key"]))
        t.add_row(Text(row_label(e)), *cells)
        if e["in_cells"] and any(c["level"] not in ("n/a",) for c in e["in_cells"].values()):
            t.add_row(Text("  └ its input", style="dim"), *[text(e["in_cells"][n]) for n in names])
    con.print(t)
    ops = sorted({o for e in report["rows"] for o in e["ops"].values() if o})
    con.print(Text(("= bitwise · ≈ rounding noise · ✗ material · " if compact else "")
                   + "◀ first row where bitwise equality breaks · ⇄ a collective (" + ", ".join(ops or ["none ran"])
                   + "; at tp 1 the output of the module that issues it) · its input: each rank's shard, compared "
                   "at the same TP size only (with the reference's batch) · noise/material: the sketch's relative "
                   "difference", style="dim"))
    v = report["verdict"]
    style = {"bitwise": "bold green", "single": "bold"}.get(v["status"], "bold yellow" if v["status"] == "noise"
                                                            else "bold red")
    con.print(Text("verdict", style="bold"))
    con.print(Text("  " + v["line"], style=style))
    for line in v["lines"]:
        con.print(Text("  " + line))
    if v.get("expect"):
        con.print(Text("  " + v["expect"], style="bold green" if report["exit_code"] == 0 else "bold red"))
    kept = report.get("kept")
    extra = f"; --keep: {len(kept['files'])} tensor files for {kept['cells']} cells" if kept else ""
    fp = report.get("fingerprints") or {}
    per = f" ({human_bytes(fp['bytes_per_row'])} per row per rank and batch, in and out)" if fp else ""
    con.print(Text(f"fingerprints{per} and report.json: {report.get('out')}{extra}", style="dim"))


def render_markdown(report: dict) -> str:
    st = report["settings"]
    names = [x["name"] for x in report["configs"]]
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    out = [f"### tpprobe invariance: {st['model']} · {st['backend']} · {st['dtype']} · reference "
           f"{st['reference']} · expect {st['expect']}", "", f"**{report['verdict']['line']}**", ""]
    out += [f"- {line}" for line in report["verdict"]["lines"]]
    if report["verdict"].get("expect"):
        out.append(f"- {report['verdict']['expect']}")
    out += ["", "| point / collective | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def md(c, n, key):
        txt = cell_text(c).replace("|", "\\|") + (" ◀" if key is not None and firsts[n] == key else "")
        return f"**{txt}**" if c["level"] in ("material", "shape", "missing") else txt
    for e in report["rows"]:
        out.append(f"| `{row_label(e)}` | " + " | ".join(md(e["cells"][n], n, e["key"]) for n in names) + " |")
        if e["in_cells"] and any(c["level"] != "n/a" for c in e["in_cells"].values()):
            out.append("| └ its input | " + " | ".join(md(e["in_cells"][n], n, None) for n in names) + " |")
    from ..report.envinfo import env_lines
    out += ["", "<details><summary>environment</summary>", "", *[f"    {x}" for x in env_lines(report)], "",
            "</details>", ""]
    return "\n".join(out)


def render_html(report: dict) -> str:
    from html import escape
    from ..report.html import CSS
    st = report["settings"]
    names = [x["name"] for x in report["configs"]]
    firsts = {x["name"]: (x["first_break"] or {}).get("row") for x in report["configs"]}
    cls = {"bitwise": "ok", "reference": "ref", "noise": "noise", "material": "bad", "shape": "shape",
           "missing": "bad", "n/a": "dim"}
    v = report["verdict"]
    vcls = {"bitwise": "ok", "noise": "noise", "single": "ref"}.get(v["status"], "bad")

    def e_(x):
        return escape(str(x), quote=True)

    def td(c, n, key, bytes_=None):
        title = "; ".join(f"{k}={c[k]}" for k in ("rel", "max_abs", "ulp_max", "ranks", "vs", "why") if c.get(k) not in
                          (None, ""))
        if bytes_:
            title += f"; message {human_bytes(bytes_)}"
        mark = " ◀" if key is not None and firsts[n] == key else ""
        return f'<td class="{cls.get(c["level"], "")}" title="{e_(title)}">{e_(cell_text(c))}{mark}</td>'
    title = f"tpprobe invariance — {st['model']} · {st['backend']} · {st['dtype']} · reference {st['reference']}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{e_(title)}</title><style>{CSS}</style></head><body>", f"<h1>{e_(title)}</h1>",
             f'<div class="sub">{e_(report["tool"])} · exit code {report["exit_code"]} · expect {e_(st["expect"])}'
             f' · output <code>{e_(report.get("out"))}</code></div>',
             f'<div class="verdict {vcls}"><div class="line">{e_(v["line"])}</div><ul>'
             + "".join(f"<li>{e_(x)}</li>" for x in v["lines"])
             + (f"<li>{e_(v['expect'])}</li>" if v.get("expect") else "") + "</ul></div>",
             "<h2>capture points and collectives × configurations</h2><table><tr><th>point / collective</th>"
             + "".join(f"<th>{e_(n)}</th>" for n in names) + "</tr>"]
    for e in report["rows"]:
        parts.append(f"<tr><td>{e_(row_label(e))}</td>"
                     + "".join(td(e["cells"][n], n, e["key"], (e.get("bytes") or {}).get(n)) for n in names) + "</tr>")
        if e["in_cells"] and any(c["level"] != "n/a" for c in e["in_cells"].values()):
            parts.append('<tr><td class="dim">&nbsp;&nbsp;└ its input (per rank)</td>'
                         + "".join(td(e["in_cells"][n], n, None) for n in names) + "</tr>")
    parts.append("</table><p class=\"sub\">◀ first row where bitwise equality breaks. Inputs are rank shards: "
                 "compared with the same TP size only (at the reference's batch). Hover a cell for its numbers.</p>")
    parts.append("<h2>configurations</h2><table><tr><th>config</th><th>level</th><th>prompt rows</th>"
                 "<th>batch lengths</th><th>first break</th></tr>")
    for x in report["configs"]:
        fb = x["first_break"]
        parts.append(f'<tr><td>{e_(x["name"])}</td><td class="{cls.get(x["level"], "ref")}">{e_(x["level"])}</td>'
                     f'<td>{e_(x["prompt_rows"])}</td><td>{e_(x["lens"])}</td><td>{e_(fb["line"] if fb else "—")}</td></tr>')
    parts.append("</table><h2>settings</h2><table>" + "".join(
        f"<tr><th>{e_(k)}</th><td>{e_(val)}</td></tr>" for k, val in st.items()) + "</table>")
    parts.append(f"<footer>{e_(report['schema'])} · generated by {e_(report['tool'])}</footer></body></html>")
    return "\n".join(parts)


def emit(report: dict, root: Path, opts: InvarianceOptions) -> None:
    from ..capture.files import atomic_write_bytes
    p = opts.probe
    atomic_write_bytes(root / "report.json", json.dumps(report, indent=1, default=str).encode())
    if p.json_out:
        sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    elif not p.quiet:
        from ..report.terminal import console
        render(report, console())
    if p.html:
        atomic_write_bytes(Path(p.html), render_html(report).encode("utf-8"))
    if p.markdown:
        atomic_write_bytes(Path(p.markdown), render_markdown(report).encode("utf-8"))
