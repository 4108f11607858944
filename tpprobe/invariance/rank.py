"""The rank side of `tpprobe invariance`: one TP size's ranks run every batch size in turn under
the probe's Tap and write tp<N>/rank<r>.json (its rows' fingerprints, in firing order).

What a forward produced comes from the Tap's public interface only:
* capture points: `tap.order` and `tap.summaries` (fingerprinted on the prompt's own rows);
* collectives: the Tap's collective audit (capture/audit/), through `Audit.observe`: every
  all-reduce's record (its input and output fingerprints are filled in when it ends), every
  all-gather and reduce-scatter with its input, each placed among the capture points where it
  began;
* site outputs: for a gather-based collective (and at tp 1, where no collective runs, for the
  modules that issue one at tp > 1) the output of the module that issues it, from a forward hook
  on those modules only. A forward that meets a gather in a module not yet watched runs again,
  watching it (once per TP size: the parent passes the modules the largest TP size issued in).
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..capture.hooks import first_tensor
from ..capture.points import EMBED_LOCAL, decoder_layer
from ..capture.record import dtype_name
from ..core.errors import UsageError
from .levels import FP_K, FP_SEED
from .options import InvarianceOptions, builtin_cfg

# the torch.distributed call each gather / reduce-scatter door stands for (the tensor form's name in
# this torch: all_gather_single since 2.13, which all_gather_into_tensor now calls)
OP_NAMES = {"c10d._allgather_base_": "all_gather_single" if hasattr(dist, "all_gather_single")
            else "all_gather_into_tensor",
            "_c10d_functional.all_gather_into_tensor": "all_gather_into_tensor", "c10d.allgather_": "all_gather",
            "c10d._reduce_scatter_base_": "reduce_scatter_tensor",
            "_c10d_functional.reduce_scatter_tensor": "reduce_scatter_tensor", "c10d.reduce_scatter_": "reduce_scatter"}


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


# ---- what one forward produced ------------------------------------------------------------------
@dataclass
class Cap:
    fp: Any
    per_token: bool
    tid: Optional[int] = None       # index into Recorder.tensors (--keep)


def gather_op(rec) -> Optional[str]:
    """The op name of a gather or reduce-scatter record (None for an all-reduce or an unread one)."""
    if rec.kind in ("all_gather", "reduce_scatter") or rec.kind == "unknown" and "reduce_scatter" in rec.path:
        return OP_NAMES.get(rec.path, rec.path)
    return None


class Recorder:
    """What one configuration's forward produced, in firing order: capture points (the Tap's),
    collectives (the Tap's audit) and the outputs of the modules that issue collectives. A Tap
    extension: `extension(tap)` observes the audit and hooks the modules in `watch`."""

    def __init__(self, select: RowSelector, keep: bool, sites: list[str], watch: set):
        self.select, self.keep = select, keep
        self.sites = set(sites)                # modules whose output always stands for a collective (tp 1)
        self.watch = set(watch) | self.sites   # modules hooked for their output
        self.tensors: list[torch.Tensor] = []
        self.events: list[tuple] = []          # (tap position, kind, payload)
        self.pending: set[str] = set()         # modules whose output closes a gather-based collective
        self.missed: set[str] = set()          # such modules that were not watched: the forward runs again
        self.modules: set[str] = set()
        self.tap = None

    def summarize(self, t: torch.Tensor) -> Cap:
        from ..fingerprint.reference import fingerprint
        rows, per_token = self.select(t.detach())
        cap = Cap(fingerprint(rows.contiguous(), seed=FP_SEED, k=FP_K), per_token)
        if self.keep:
            cap.tid = len(self.tensors)
            self.tensors.append(rows.detach().to("cpu").clone())
        return cap

    def extension(self, tap) -> list:
        self.tap = tap
        mods = dict(tap.model.named_modules())
        self.modules = {n for n in mods if n}
        handles = [tap.auditor.observe(self._began)]
        for name in sorted(self.watch & self.modules):
            handles.append(mods[name].register_forward_hook(lambda mod, a, out, _n=name: self._module_out(_n, out)))
        return handles

    def _began(self, rec, inp) -> None:
        """A collective began (the audit recorded it): noted where it began among the capture points."""
        pos = len(self.tap.order)
        if rec.kind == "all_reduce":           # its summaries are filled in when it ends
            self.events.append((pos, "allreduce", rec))
            return
        op = gather_op(rec)
        if op is None or not isinstance(inp, torch.Tensor):
            return
        site = rec.source or rec.module
        if site not in self.modules:
            # issued outside every module the Tap places (SGLang's logits all-gather after the last
            # layer, downstream of every capture point): no module's output stands for its value
            return
        summ = rec.inp_summary if isinstance(rec.inp_summary, Cap) else self.summarize(inp)
        info = {"op": op, "site": site, "module": rec.module, "layer": rec.layer, "where": rec.where,
                "shape": list(inp.shape), "dtype": rec.dtype, "bytes": inp.numel() * inp.element_size(), "in": summ}
        self.events.append((pos, "collective", info))
        self.pending.add(site)
        if site not in self.watch:
            self.missed.add(site)

    def _module_out(self, name: str, out) -> None:
        if name not in self.pending and name not in self.sites:
            return
        t = first_tensor(out)
        if t is None or not t.dtype.is_floating_point:
            return
        self.pending.discard(name)
        self.events.append((len(self.tap.order), "site_out", {"site": name, "out": self.summarize(t)}))


def _rows(rec: "Recorder", tap, world: int) -> list[dict]:
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


def _cap_json(cap: Optional[Cap], keep_ids: dict, key: str) -> Optional[dict]:
    if cap is None:
        return None
    d = {"fp": cap.fp.to_json(), "per_token": cap.per_token}
    if cap.tid is not None:
        keep_ids[key] = cap.tid
    return d


def run_config(target, batch: int, opts: InvarianceOptions, world: int, watch: set) -> tuple[dict, dict, set]:
    """One forward of the prompt inside `batch` prompts under the Tap; its rows (JSON), with --keep
    the prompt rows of every fingerprinted tensor, and the modules that issued a gather-based
    collective while not in `watch` (their output was not read: the caller runs it again)."""
    from ..capture.hooks import Tap
    p = opts.probe
    vocab = int(target.info.get("vocab") or (int(target.input_ids.max()) + 1))
    seqs, idx = make_batch(target.input_ids, batch, vocab, p.seed)
    lens = [int(s.numel()) for s in seqs]
    rec = Recorder(RowSelector(target.batch_layout if target.forward_batch else "packed", lens, idx),
                   opts.keep, opts.sites if world == 1 else [], watch)
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
            "forward_s": seconds, "rows": out_rows}, tensors, rec.missed


def build(ctx, opts: InvarianceOptions):
    from ..engines.registry import engine_of
    p = opts.probe
    engine = engine_of(p)
    if engine.builtin_shapes:          # the built-in model with the grid's reduction (--reduce, --switch-above)
        from ..engines.builtin.model import build_builtin
        return build_builtin(ctx, builtin_cfg(opts, p.layers))
    return engine.build(ctx, p, [])    # no aux capture: the grid compares the streams


def _configs(target, opts: InvarianceOptions, world: int) -> tuple[list[dict], dict]:
    """Every batch size in turn; a forward that met a gather in a module not watched yet runs again."""
    configs, kept, watch = [], {}, set(opts.sites)
    for b in opts.batch:
        cfg, tensors, missed = run_config(target, b, opts, world, watch)
        if missed:
            watch |= missed
            cfg, tensors, missed = run_config(target, b, opts, world, watch)
        configs.append(cfg)
        kept.update({f"b{b}|{k}": v for k, v in tensors.items()})
    return configs, kept


def rank_main(opts: InvarianceOptions) -> int:
    """One rank of one TP size: every batch size in turn; writes tp<N>/rank<r>.json."""
    import faulthandler
    from ..capture.audit import prepare as prepare_audit
    from ..formats.capture_dir import atomic_save_tensors, atomic_write_bytes
    from ..exchange.dist import env_rank, init, named_process_group, shutdown
    p = opts.probe
    out = Path(p.out)
    faulthandler.enable()       # a rank that dies in native code (NCCL, a kernel) still says where
    rank = (env_rank() or (0, 1, 0))[0]
    code, ctx = 0, None
    try:
        # inside the try: a rank whose process group cannot start writes why (never "wrote nothing")
        ctx = init(named_process_group(p.backend), p.timeout, p.seed)
        if ctx.world_size not in opts.tp or len(opts.tp) != 1:
            raise UsageError("the rank side runs one TP size: --tp N with N = the number of ranks")
        target = build(ctx, opts)
        if target.forward_batch is None and max(opts.batch) > 1:
            raise UsageError(f"--model {p.model}: its ProbeTarget has no forward_batch, so it runs one prompt "
                             f"at a time: use --batch 1, or give it forward_batch (docs/invariance.md)")
        prepare_audit(target.model)     # the audit's one-off registration, before the first forward
        configs, kept = _configs(target, opts, ctx.world_size)
        doc = {"tp": ctx.world_size, "rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
               "arch": target.arch, "dtype": dtype_name(target.dtype),
               "tokens": int(target.input_ids.numel()), "hidden": target.hidden_size,
               "layout": target.batch_layout if target.forward_batch else "single",
               "info": {k: v for k, v in target.info.items() if isinstance(v, (int, float, str))},
               "configs": configs}
        if kept:
            atomic_save_tensors(out / f"rank{ctx.rank}.safetensors", {k: v.contiguous() for k, v in kept.items()}, {})
    except UsageError as e:
        doc, code = {"tp": opts.tp[0], "rank": rank, "error": str(e), "code": 2}, 2
    except Exception as e:   # a bug or a broken model on this rank: its traceback, then a one-line cause
        import traceback
        traceback.print_exc()
        doc, code = {"tp": opts.tp[0], "rank": rank, "code": 1,
                     "error": f"rank {rank} of tp {opts.tp[0]} failed"
                              f"{'' if ctx else ' to start its process group'}: {type(e).__name__}: {e}"}, 1
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / f"rank{rank}.json", json.dumps(doc).encode())
    if ctx is not None:
        shutdown(ctx)
    return code
