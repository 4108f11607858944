"""What vLLM's EAGLE-3 drafter receives, and vLLM's own acceptance, captured live on every TP rank.

Installed by the plugin's `attach` (tpprobe.engines.vllm.worker) in each worker process; inert until a drafter
runs. Two class-level wraps, each once per process:

* `SpecDecodeBaseProposer.propose` (vllm/v1/spec_decode/llm_base_proposer.py): for a step the plugin captures
  (the same window as the target's forward: TPPROBE_MAX_STEPS / TPPROBE_FORWARD_MODES / tpprobe_capture), its
  `target_hidden_states` (the runner's `torch.cat` of the aux list: what the draft's `fc` reads) are compared,
  slot by slot, with the target's own streams of the same forward (forward hooks on the embedding and every
  decoder layer, armed for that forward only: vLLM id k = the stream entering layer k = the embedding output
  for k = 0, layer k-1's `hidden_states + residual` after it; a layer's `hidden_states` alone is a candidate
  too). Rows are split per request (`common_attn_metadata.query_start_loc_cpu`; a verify request's rows of
  rejected drafts, `num_rejected_tokens_gpu`, are marked). Written to the step's folder:
  DIR/dp{D}-pp{P}/step-N-MODE/drafter/rank-R.json (every rank: layout, slot matches, a fingerprint for the
  cross-rank check) and, on TP rank 0 within the byte budget, rank-000.safetensors (target_hidden_states, the
  streams, the token ids) for an offline replay of the draft.
* `RejectionSampler.forward` (vllm/v1/sample/rejection_sampler.py): vLLM's own verification of the drafts, per
  request: `metadata.num_draft_tokens` and the valid tokens of its output (accepted drafts + 1, the rest -1), the
  numbers vLLM's scheduler turns into `vllm:spec_decode_*` (SpecDecodingStats.observe_draft). Counted for the
  whole run (in Python on CPU, on the device elsewhere); TP rank 0 writes DIR/dp{D}-pp{P}/acceptance.json
  (run so far) at every captured step, and at every verify step on CPU / at most once a second on a device.

Nothing here changes what the engine computes; an error is logged once and the capture of the drafter stops.
"""
from __future__ import annotations

from tpprobe.config.knobs import knob

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

# process-wide by nature: one vLLM worker process serves one TP rank; its drafter capture's state
_D: dict = {"installed": False, "model": None, "armed": None, "streams": {}, "hidden": {}, "hooks": [],
            "failed": False, "bytes": 0, "last_write": 0.0}
_ACC: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [], "steps": 0, "dev": None,
              "last": None}
MATCH = 1e-6          # rel diff² under which a slot IS a stream (the same float32 sum: 0 in practice)


def _say(msg: str) -> None:
    _D["say"](msg)


def settings():
    return _D["settings"]()


def install(model, say, ranks, forwards, bytes_written, settings) -> None:
    """Hook `model` (the target) and wrap the proposer and the rejection sampler, once per process. The worker's
    `say` (its log line), `ranks()` (vLLM's parallel ranks), `forwards()` (forwards since attach),
    `bytes_written()` (the target capture's bytes on this rank, for the shared byte budget) and `settings()` (the
    plugin's settings, None when off)."""
    if _D["installed"]:
        return
    _D["installed"] = True
    _D.update(model=model, say=say, ranks=ranks, forwards=forwards, bytes_written=bytes_written, settings=settings)
    try:
        inner = getattr(model, "model", model)
        layers = list(getattr(inner, "layers", None) or [])
        emb = getattr(inner, "embed_tokens", None)
        if emb is not None:
            _D["hooks"].append(emb.register_forward_hook(_embed_hook))
        for k, layer in enumerate(layers):
            _D["hooks"].append(layer.register_forward_hook(_layer_hook(k)))
        _D["num_layers"] = len(layers)
        _wrap_propose()
        _wrap_rejection()
    except Exception as e:  # noqa: BLE001 - no drafter capture; the engine and the rest of the plugin go on
        _D["failed"] = True
        _say(f"drafter capture not installed: {type(e).__name__}: {e}")


def stop() -> None:
    """The plugin's capture failed and stopped (its one line said so, tpprobe.engines.vllm.worker): the drafter's
    capture and the acceptance file stop with it, silently (their folder is the one that failed); vLLM's acceptance
    is still counted (`tpprobe_status`)."""
    _D["failed"], _D["stopped"] = True, True
    _D["armed"], _D["streams"], _D["hidden"] = None, {}, {}


def arm(step: int, mode: str) -> None:
    """The next target forward is captured step `step`: keep its streams for the proposer that follows it."""
    _D["armed"] = {"step": step, "mode": mode}
    _D["streams"], _D["hidden"] = {}, {}


def _embed_hook(module, args, out):
    if _D["armed"] is not None and isinstance(out, torch.Tensor):
        _D["streams"][0] = out.detach().clone()


def _layer_hook(k: int):
    def hook(module, args, out):
        if _D["armed"] is None or not isinstance(out, tuple) or len(out) < 2:
            return
        h, r = out[0], out[1]
        if isinstance(h, torch.Tensor):
            _D["hidden"][k + 1] = h.detach().clone()
            _D["streams"][k + 1] = (h + r).detach().clone() if isinstance(r, torch.Tensor) else h.detach().clone()
    return hook


# ---- vLLM's own acceptance -------------------------------------------------------------------------------------
def _wrap_rejection() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    if getattr(RejectionSampler.forward, "_tpprobe", False):
        return
    orig = RejectionSampler.forward

    def forward(self, metadata, *args, **kwargs):
        out = orig(self, metadata, *args, **kwargs)
        try:
            _count(metadata, out)
        except Exception as e:  # noqa: BLE001 - counting is ours: never the engine's problem
            if not _ACC.get("said"):
                _ACC["said"] = True
                _say(f"acceptance counting stopped: {type(e).__name__}: {e}")
        return out

    forward._tpprobe = True
    RejectionSampler.forward = forward


def _count(metadata, out) -> None:
    n = _D["forwards"]()
    if n == 0:          # the engine's warm-up (dummy metadata) before the first request
        return
    ids = getattr(out, "sampled_token_ids", None)
    n_draft = list(metadata.num_draft_tokens)
    if ids is None or not n_draft:
        return
    k = max(n_draft)
    if ids.device.type == "cpu":        # a few numbers: plain Python is cheaper than tensor ops
        acc = [min(max(sum(1 for x in row[:k + 1] if x != -1) - 1, 0), nd) for row, nd in zip(ids.tolist(), n_draft)]
        pos = [sum(1 for a in acc if a > j) for j in range(k)]
        c = _ACC.setdefault("cpu", {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []})
        c["drafts"] += sum(1 for x in n_draft if x > 0)
        c["draft_tokens"] += sum(n_draft)
        c["accepted"] += sum(acc)
        c["per_pos"] += [0] * (k - len(c["per_pos"]))
        for j, x in enumerate(pos):
            c["per_pos"][j] += x
        _ACC["last"] = {"at_forward": n, "requests": len(n_draft), "num_draft_tokens": n_draft, "accepted": acc,
                        "pos": pos}
        _ACC["steps"] += 1
        _write_acceptance(time.time())
        return
    valid = (ids[:, : k + 1] != -1).sum(dim=1) - 1          # accepted drafts per request
    nd = torch.tensor(n_draft, device=valid.device)
    acc_t = torch.minimum(valid.clamp(min=0), nd)
    pos_t = (acc_t.unsqueeze(1) > torch.arange(k, device=acc_t.device).unsqueeze(0)).sum(dim=0)
    dev = _ACC["dev"]
    if dev is None or dev.shape[0] < k + 3:
        grown = torch.zeros(k + 3, dtype=torch.long, device=acc_t.device)
        if dev is not None:
            grown[:dev.shape[0]] += dev
        dev = _ACC["dev"] = grown
    dev[0] += int(sum(1 for x in n_draft if x > 0))
    dev[1] += int(sum(n_draft))
    dev[2] += acc_t.sum()
    dev[3:3 + k] += pos_t
    _ACC["last"] = {"at_forward": n, "requests": len(n_draft), "num_draft_tokens": n_draft, "accepted": acc_t,
                    "pos": pos_t}
    _ACC["steps"] += 1
    now = time.time()
    if now - _D["last_write"] >= 1.0:    # a read from the device: at most once a second (and at captured steps)
        _write_acceptance(now)


def run_so_far() -> dict:
    """The run's acceptance so far, vLLM's counts (read from the device when counted there)."""
    c = _ACC.get("cpu")
    if c is not None:
        return {"drafts": c["drafts"], "draft_tokens": c["draft_tokens"], "accepted": c["accepted"],
                "accepted_per_pos": list(c["per_pos"]), "verify_steps": _ACC["steps"]}
    dev = _ACC["dev"]
    if dev is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [], "verify_steps": 0}
    v = dev.tolist()
    per_pos = v[3:]
    while len(per_pos) > 1 and per_pos[-1] == 0:
        per_pos.pop()
    return {"drafts": v[0], "draft_tokens": v[1], "accepted": v[2], "accepted_per_pos": per_pos,
            "verify_steps": _ACC["steps"]}


def _write_acceptance(now: float) -> None:
    """TP rank 0 writes the group's acceptance.json: replaced whole (a reader never sees half of it), not
    fsynced (it is rewritten at every verify step on CPU: a counter, not a record to keep)."""
    s, par = settings(), _D["ranks"]()
    if s is None or _D.get("stopped") or par.get("tp_rank", 0) != 0:
        return
    _D["last_write"] = now
    folder = Path(s["dir"]) / f"dp{par['dp_rank']}-pp{par['pp_rank']}"
    if not _D.get("acc_dir"):
        folder.mkdir(parents=True, exist_ok=True)
        _D["acc_dir"] = True
    doc = {"source": "vllm-plugin", "counted_at": "vllm RejectionSampler.forward (the engine's verification)",
           "updated": now, **run_so_far()}
    tmp = folder / f".acceptance.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, folder / "acceptance.json")


# ---- the drafter's input ---------------------------------------------------------------------------------------
def _wrap_propose() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if getattr(SpecDecodeBaseProposer.propose, "_tpprobe", False):
        return
    orig = SpecDecodeBaseProposer.propose

    def propose(self, *args, **kwargs):
        if _D["armed"] is not None and not _D["failed"]:
            try:
                _capture(self, args, kwargs)
            except Exception as e:  # noqa: BLE001 - the plugin's own error: said once, the engine goes on
                _D["failed"] = True
                _say(f"drafter capture FAILED at step {(_D['armed'] or {}).get('step')}, it stops (the engine goes "
                     f"on): {type(e).__name__}: {e}")
            finally:
                _D["armed"], _D["streams"], _D["hidden"] = None, {}, {}
        return orig(self, *args, **kwargs)

    propose._tpprobe = True
    SpecDecodeBaseProposer.propose = propose


_ARGS = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
         "token_indices_to_sample", "common_attn_metadata", "sampling_metadata")


def _arg(args, kwargs, name):
    if name in kwargs:
        return kwargs[name]
    i = _ARGS.index(name) if name in _ARGS else None
    return args[i] if i is not None and i < len(args) else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = float((a * a).sum() + (b * b).sum())
    return float(((a - b) ** 2).sum()) / den if den > 0 else 0.0


def _fingerprint(t: torch.Tensor) -> dict:
    x = t.detach().double().cpu()
    return {"sum": float(x.sum()), "sumsq": float((x * x).sum()), "sketch": _sketch(x),
            "finite": bool(torch.isfinite(x).all())}


def _sketch(t: torch.Tensor) -> list:
    """A linear sketch of a [rows, width] tensor (a seeded projection summed over rows): the sketch of a sum is the
    sum of the sketches, so ranks' sketches tell a partial sum from the stream it should be."""
    x = t.detach().double().cpu()
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(x.shape[-1], 4, generator=g, dtype=torch.float64)
    return (x @ proj).sum(0).tolist()


def _requests(cad, rows: int, rejected) -> list[dict]:
    qsl = getattr(cad, "query_start_loc_cpu", None)
    if qsl is None:
        return [{"index": 0, "rows": [0, rows], "rejected_rows": 0}]
    q = [int(x) for x in qsl.tolist()]
    rej = [int(x) for x in rejected.tolist()] if isinstance(rejected, torch.Tensor) else [0] * (len(q) - 1)
    out = []
    for i in range(len(q) - 1):
        out.append({"index": i, "rows": [q[i], q[i + 1]], "rejected_rows": rej[i] if i < len(rej) else 0})
    return out


def _capture(proposer, args, kwargs) -> None:
    from tpprobe.engines.sglang.plugin import step_dir

    s = settings()
    armed = _D["armed"]
    if s is None or armed is None:
        return
    step, mode = armed["step"], armed["mode"]
    ths = _arg(args, kwargs, "target_hidden_states")
    if not isinstance(ths, torch.Tensor):
        return
    par = _D["ranks"]()
    rank, world = par.get("tp_rank", 0), par.get("tp_size", 1)
    rows, width = int(ths.shape[0]), int(ths.shape[-1])
    model = _D["model"]
    holder = getattr(model, "model", model)
    engine_ids = [int(i) for i in getattr(holder, "aux_hidden_state_layers", ()) or ()]
    cfg = getattr(getattr(getattr(proposer, "vllm_config", None), "speculative_config", None),
                  "draft_model_config", None)
    hf = getattr(cfg, "hf_config", None)
    eagle = getattr(hf, "eagle_config", None) or {}
    config_ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or \
        (eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None)
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    n_slots = width // hidden if hidden and width % hidden == 0 else None
    streams = {k: v[:rows] for k, v in _D["streams"].items() if v.shape[0] >= rows}
    alone = {k: v[:rows] for k, v in _D["hidden"].items() if v.shape[0] >= rows}
    slots = []
    rule = sorted({int(i) for i in (engine_ids or config_ids or [])})
    for j in range(n_slots or 0):
        x = ths[:, j * hidden:(j + 1) * hidden]
        rel = {f"id {k}": _rel(x, v) for k, v in sorted(streams.items())}
        rel.update({f"layer {k - 1} hidden_states without the residual": _rel(x, v) for k, v in sorted(alone.items())})
        best = min(rel, key=rel.get) if rel else None
        same = [k for k in rel if rel[k] < MATCH]
        # two streams can be equal (a layer that adds nothing): the slot holds both, and the id vLLM's rule gives
        # is the one it was captured as
        want = f"id {rule[j]}" if j < len(rule) else None
        holds = want if want in same else (best if best in same else None)
        k = int(holds.split()[1]) if holds and holds.startswith("id ") else None
        slots.append({"slot": j, "holds": holds, "id": k, "best": best, "rel": rel.get(best) if best else None,
                      "equal_streams": [x for x in same if x != holds],
                      # the slot and, for a layer's stream, its hidden_states part: across ranks, a slot that
                      # differs while its residual (slot - hidden_states) agrees holds each rank's partial sum
                      "sketch": _sketch(x), "hidden_sketch": _sketch(alone[k]) if k in alone else None})
    rejected = _arg(args, kwargs, "num_rejected_tokens_gpu") if "num_rejected_tokens_gpu" in kwargs else None
    reqs = _requests(_arg(args, kwargs, "common_attn_metadata"), rows, rejected)
    pos = _arg(args, kwargs, "target_positions")
    if isinstance(pos, torch.Tensor) and pos.dim() == 1:
        for r in reqs:
            a, b = r["rows"]
            r["kind"] = "prefill" if b > a and int(pos[a]) == 0 else ("verify" if b - a > 1 else "decode")
            r["first_position"] = int(pos[a]) if b > a else None
    last = _ACC["last"]
    step_acc = None
    if last is not None and last["at_forward"] == step + 1:
        step_acc = {"requests": last["requests"], "num_draft_tokens": last["num_draft_tokens"],
                    "accepted": _list(last["accepted"]), "accepted_per_pos": _list(last["pos"])}
    meta = {"source": "vllm-plugin drafter", "step": step, "forward_mode": mode, "tp_rank": rank, "tp_size": world,
            "proposer": type(proposer).__name__, "target_arch": type(model).__name__,
            "target_model": _abs(getattr(getattr(getattr(proposer, "vllm_config", None), "model_config", None),
                                         "model", None)), "method": getattr(proposer, "method", None),
            "draft_model": _abs(getattr(cfg, "model", None)), "draft_config_ids": list(config_ids or []),
            "engine_ids": engine_ids, "num_layers": _D.get("num_layers"), "hidden": hidden, "rows": rows,
            "width": width, "n_slots": n_slots, "dtype": str(ths.dtype).replace("torch.", ""),
            "contiguous": bool(ths.is_contiguous()), "slots": slots, "requests": reqs,
            "streams_seen": sorted(streams), "fingerprint": _fingerprint(ths), "acceptance": step_acc,
            **_trained(list(config_ids or []), n_slots, rank), "kept": False}
    out = step_dir(s["dir"], par, step, mode) / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        tensors = {"target_hidden_states": ths.detach().contiguous().cpu()}
        tok = _arg(args, kwargs, "target_token_ids")
        if isinstance(tok, torch.Tensor):
            tensors["target_token_ids"] = tok[:rows].detach().contiguous().cpu()
        if isinstance(pos, torch.Tensor):
            tensors["target_positions"] = pos.detach().contiguous().cpu()
        for k, v in streams.items():
            tensors[f"stream.{k}"] = v.detach().contiguous().cpu()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if _D["bytes_written"]() + _D["bytes"] + nbytes <= s["max_bytes"]:
            from safetensors.torch import save_file

            save_file(tensors, str(out / f"rank-{rank:03d}.safetensors"))
            _D["bytes"] += nbytes
            meta["kept"] = True
    from tpprobe.formats.capture_dir import atomic_write_bytes

    atomic_write_bytes(out / f"rank-{rank:03d}.json", json.dumps(meta, indent=1).encode())
    if rank == 0:
        _write_acceptance(time.time())


def _trained(config_ids: list, n_slots: Optional[int], rank: int) -> dict:
    """What the user says the draft was trained on (TPPROBE_DRAFT_TRAINED, its grammar checked when the plugin
    turned on), as this step's record keeps it: a list of HF hidden_states of another length than the draft's
    slots is refused, one line (TP rank 0, once), recorded as `trained_refused` and never used."""
    spec = knob("TPPROBE_DRAFT_TRAINED") or None
    if not spec:
        return {"trained": None}
    from tpprobe.engines.draft_training import parse, slot_count_mismatch
    from tpprobe.engines.vllm.acceptance import FIELD

    training = parse(spec) or {}
    why = slot_count_mismatch(spec, training["hidden_states"], config_ids, n_slots, FIELD,
                              "the slots the drafter received") if "hidden_states" in training else ""
    if not why:
        return {"trained": spec}
    if rank == 0 and not _D.get("trained_said"):
        _D["trained_said"] = True
        _say(f"drafter: {why}; not used: the drafter's input is checked against the draft's config only")
    return {"trained": None, "trained_refused": why}


def _list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _abs(path) -> str:
    """A model's folder as an absolute path (the engine's cwd is this worker's), "" for none."""
    return os.path.abspath(str(path)) if path else ""


def status() -> dict:
    return {"installed": _D["installed"], "failed": _D["failed"], "acceptance": run_so_far()}


def trained_ids_from_env() -> Optional[str]:
    return knob("TPPROBE_DRAFT_TRAINED") or None
