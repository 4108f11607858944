"""Capture folders: written atomically by each rank, read back without executing anything.

Layout of a capture folder (schema `tpprobe.capture/1`):
  manifest.json          run settings, ranks, and for every file its sha256 and size
  rank-NNN.safetensors   that rank's captured tensors (capture points, the packed aux tensor,
                         audited all-reduce inputs/outputs when kept, input_ids)
  rank-NNN.json          that rank's metadata: status, capture points in model order, the
                         all-reduce audit, fingerprints, parameter hashes, progress
  report.json            the checks' numbers and findings (rank 0)

Each rank writes its own two files in parallel (no funnel through rank 0); rank 0 writes the
manifest from what every rank posted. `load_run` verifies the manifest (paths stay inside the
folder, sizes and sha256 match) and reads tensors with safetensors only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CaptureError, UsageError

SCHEMA = "tpprobe.capture/1"
MANIFEST = "manifest.json"


def rank_stem(rank: int) -> str:
    return f"rank-{rank:03d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    cpu, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        if v.untyped_storage().data_ptr() in seen:   # safetensors refuses shared storage
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        cpu[k] = v
    save_file(cpu, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_entry(out: Path, name: str, rank: Optional[int]) -> dict:
    p = out / name
    return {"path": name, "rank": rank, "size": p.stat().st_size, "sha256": sha256_file(p)}


def write_rank(out: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict) -> list[dict]:
    """Write this rank's tensors and metadata; return their manifest entries."""
    stem = rank_stem(rank)
    atomic_save_tensors(out / f"{stem}.safetensors", tensors, {"schema": SCHEMA, "rank": str(rank)})
    atomic_write_bytes(out / f"{stem}.json", json.dumps(meta, indent=1, default=str).encode())
    return [file_entry(out, f"{stem}.safetensors", rank), file_entry(out, f"{stem}.json", rank)]


def write_manifest(out: Path, settings: dict, files: list[dict]) -> None:
    manifest = {"schema": SCHEMA, **settings, "files": files}
    atomic_write_bytes(out / MANIFEST, json.dumps(manifest, indent=1).encode())


def estimate_bytes(n_tensors: int, tokens: int, hidden: int, dtype: torch.dtype) -> int:
    return n_tensors * tokens * hidden * torch.empty((), dtype=dtype).element_size()


def check_out_dir(out: Path, need_bytes: int) -> None:
    """Refuse up front: an unwritable folder, or less free space than the capture needs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".tpprobe-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror or e}; choose a writable folder")
    free = shutil.disk_usage(out).free
    if need_bytes * 1.1 + (16 << 20) > free:
        raise UsageError(f"--out {out} has {free / 1e6:.1f} MB free but this probe writes about "
                         f"{need_bytes / 1e6:.1f} MB; free space or choose another folder")


# -- reading ---------------------------------------------------------------------------------
@dataclass
class RankRecord:
    rank: int
    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class LoadedRun:
    path: Path
    manifest: dict
    records: dict[int, RankRecord]
    problems: list[dict]          # {"file", "rank", "problem"} for every file that failed to verify


def _safe_member(root: Path, name) -> Path:
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name:
        raise CaptureError(f"{root / MANIFEST}: file path {name!r} is not a plain relative name; "
                           f"the manifest is corrupt or hostile")
    p = (root / name).resolve()
    if root.resolve() not in p.parents:
        raise CaptureError(f"{root / MANIFEST}: file path {name!r} leaves the capture folder; refused")
    return p


def read_manifest(root: Path) -> dict:
    mp = root / MANIFEST
    if not root.is_dir():
        raise CaptureError(f"{root}: not a folder; expected a tpprobe capture folder with {MANIFEST}")
    if not mp.is_file():
        raise CaptureError(f"{mp}: missing; expected a tpprobe capture folder (written by "
                           f"`tpprobe probe --out` or the SGLang plugin)")
    try:
        manifest = json.loads(mp.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureError(f"{mp}: not valid JSON ({e}); the manifest is corrupt")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise CaptureError(f"{mp}: schema {got!r}, expected {SCHEMA!r}")
    files = manifest.get("files")
    ws = manifest.get("world_size")
    if not isinstance(files, list) or not isinstance(ws, int) or ws < 1:
        raise CaptureError(f"{mp}: needs 'files' (a list) and 'world_size' (a positive integer)")
    for e in files:
        if not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str) \
                or not (e.get("rank") is None or isinstance(e.get("rank"), int)):
            raise CaptureError(f"{mp}: file entry {str(e)[:80]!r} needs path, rank, size, sha256")
        _safe_member(root, e.get("path"))
    return manifest


def load_run(path, verify: bool = True) -> LoadedRun:
    """Load every rank it can; `problems` names each file that is missing, extra or corrupt."""
    root = Path(path)
    manifest = read_manifest(root)
    problems: list[dict] = []
    listed = set()
    ok_files: dict[str, dict] = {}
    for e in manifest["files"]:
        p = _safe_member(root, e["path"])
        listed.add(p.name)
        if not p.is_file():
            problems.append({"file": e["path"], "rank": e.get("rank"), "problem": "missing"})
        elif p.stat().st_size != e["size"]:
            problems.append({"file": e["path"], "rank": e.get("rank"),
                             "problem": f"size {p.stat().st_size} bytes, manifest says {e['size']} (truncated or replaced)"})
        elif verify and sha256_file(p) != e["sha256"]:
            problems.append({"file": e["path"], "rank": e.get("rank"), "problem": "sha256 differs from the manifest (corrupted)"})
        else:
            ok_files[e["path"]] = e
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name not in listed and p.name not in (MANIFEST, "report.json") \
                and not p.name.startswith(".") and p.suffix in (".safetensors", ".json", ".pt"):
            problems.append({"file": p.name, "rank": None, "problem": "not in the manifest (extra file; ignored)"})

    records: dict[int, RankRecord] = {}
    for rank in range(manifest["world_size"]):
        stem = rank_stem(rank)
        js, st = f"{stem}.json", f"{stem}.safetensors"
        if js not in ok_files:
            continue
        try:
            meta = json.loads((root / js).read_text())
            if not isinstance(meta, dict):
                raise ValueError("not an object")
        except (UnicodeDecodeError, ValueError) as e:
            problems.append({"file": js, "rank": rank, "problem": f"unreadable JSON ({e})"})
            continue
        tensors: dict[str, torch.Tensor] = {}
        if st in ok_files:
            try:
                tensors = load_file(str(root / st))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                problems.append({"file": st, "rank": rank, "problem": f"not a readable safetensors file ({e})"})
                continue
        elif any(p["file"] == st for p in problems) or meta.get("tensors_file", True):
            continue  # its tensors are unusable: do not report this rank from metadata alone
        records[rank] = RankRecord(rank, meta, tensors)
    return LoadedRun(root, manifest, records, problems)


def load_rank_files(root: Path, rank: int, entries: list[dict]) -> RankRecord:
    """One rank's record from its two files, verified against the entries it posted."""
    for e in entries:
        p = _safe_member(root, e["path"])
        if not p.is_file() or p.stat().st_size != e["size"] or sha256_file(p) != e["sha256"]:
            raise CaptureError(f"{p}: missing or differs from what rank {rank} reported writing")
    stem = rank_stem(rank)
    try:
        meta = json.loads((root / f"{stem}.json").read_text())
        tensors = load_file(str(root / f"{stem}.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise CaptureError(f"{root / stem}: unreadable ({e})")
    return RankRecord(rank, meta, tensors)
