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
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .safe_load import torch_load
from ..capture.record import RankRecord
from ..core.errors import CaptureError, UsageError

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
    """Write `path` whole or not at all: a temporary beside it, renamed over it; the temporary is
    removed when anything fails (no `.NAME.tmp-PID` is left behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    cpu, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        if v.untyped_storage().data_ptr() in seen:   # safetensors refuses shared storage
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        cpu[k] = v
    try:
        save_file(cpu, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())   # safetensors writes 0600: readable like the .json beside it
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


RUNS_DIR = "tpprobe-runs"


def default_out_dir(kind: str = "") -> str:
    """A fresh folder under ./tpprobe-runs (that one folder is created here if absent), named
    `[KIND-]YYYYmmdd-HHMMSS-XXXX`."""
    import time
    Path(RUNS_DIR).mkdir(exist_ok=True)
    return f"{RUNS_DIR}/{kind + '-' if kind else ''}{time.strftime('%Y%m%d-%H%M%S-')}{os.urandom(2).hex()}"


def earlier_run_files(out: Path) -> list[str]:
    """The files of an earlier tpprobe run in `out` (its manifest, report, rank files, invariance
    parts): a new run never writes over them nor mixes its ranks with theirs."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir()
                  if p.name in (MANIFEST, "report.json") or p.name.startswith("rank-")
                  or (p.is_dir() and p.name.startswith("tp") and (p / MANIFEST).exists()))


def remove_if_empty(out: Path) -> None:
    """A run that stopped before writing anything leaves no folder behind."""
    try:
        out.rmdir()     # only an empty folder: never anything a user put there
    except OSError:
        pass


def check_parent_exists(path: Path, flag: str) -> None:
    """Only the last folder of a path is ever created: a missing parent is a typo, not a request
    (except ./tpprobe-runs itself, tpprobe's own folder, which the default creates too)."""
    parent = Path(path).absolute().parent
    if parent == Path(RUNS_DIR).absolute():
        parent.mkdir(exist_ok=True)
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"cannot write to {flag} {path}: {parent} is a file, not a folder; choose a writable folder")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist (tpprobe creates only the last "
                         f"folder of a path); create it first or fix the path")


def capture_file_of(path: Path, capture: Optional[Path] = None) -> Optional[tuple[str, Path]]:
    """(what it names, the folder) when writing `path` would replace a file of a capture folder: the manifest,
    report.json or a rank's files of a tpprobe capture folder (its manifest says so, or it holds a rank's
    tensors and metadata, or it is `capture`, the folder a run is about to fill), or a .pt file of an SGLang
    dumper folder; else None (a file of that name elsewhere is an ordinary output)."""
    import re
    real = Path(os.path.realpath(Path(path).absolute()))       # a link to a capture's file is that file
    folder, name = real.parent, real.name
    capturing = capture is not None and Path(os.path.realpath(Path(capture).absolute())) == folder
    if name.endswith(".pt") and not capturing:
        from .sglang_dump import holds_dump_files
        if holds_dump_files(folder):
            return "a .pt file of", folder
        return None
    rank = re.fullmatch(r"rank-(\d+)\.(safetensors|json)", name)
    what = ("the manifest of" if name == MANIFEST else "the report.json of" if name == "report.json" else
            f"rank {int(rank.group(1))}'s {'tensors' if rank.group(2) == 'safetensors' else 'metadata'} in" if rank
            else None)
    if what is None:
        return None
    if capturing or _is_capture_folder(folder):
        return what, folder
    return None


def _is_capture_folder(folder: Path) -> bool:
    """A tpprobe capture folder: its manifest says so, or (the manifest lost) it holds a rank's two files."""
    try:
        schema = json.loads((folder / MANIFEST).read_text()).get("schema")
        if isinstance(schema, str) and schema.startswith("tpprobe."):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return any((folder / f"{p.name[:-len('.safetensors')]}.json").is_file()
                   for p in folder.glob("rank-*.safetensors"))
    except OSError:
        return False


def check_file_path(path: Path, flag: str, capture: Optional[Path] = None) -> None:
    """A file tpprobe writes may go into a new folder, but only one: that folder's parent must exist. It
    never replaces a file of a capture folder (capture_file_of; `capture`: the folder this run fills)."""
    example = {"--markdown": "report.md", "sample": "data_0.ckpt"}.get(flag, "report.html")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name, e.g. {flag} {Path(path) / example}")
    own = capture_file_of(Path(path), capture)
    if own is not None:
        what, folder = own
        kind = "SGLang dumper folder" if what.endswith(".pt file of") else "capture folder"
        raise UsageError(f"{flag} {path} names {what} the {kind} {folder}: tpprobe never writes over a capture's "
                         f"own files; give another file name, e.g. {flag} {folder / example}")
    folder = Path(path).absolute().parent
    for f in (folder.parent, folder):
        if f.exists() and not f.is_dir():
            raise UsageError(f"cannot write to {flag} {path}: {f} is a file, not a folder; choose a writable folder")
    if not folder.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder.parent} does not exist (tpprobe creates only the last "
                         f"folder of a path); create it first or fix the path")


def make_file_folder(path: Path, flag: str) -> None:
    check_file_path(path, flag)
    Path(path).absolute().parent.mkdir(exist_ok=True)


HEADROOM = 16 << 20   # bytes kept free beyond the estimate (manifest, report, the filesystem's own)


def check_out_dir(out: Path, need_bytes: int) -> None:
    """Refuse up front: an unwritable folder, or less free space than the capture needs.

    need_bytes <= 0 checks only that the folder can be created and written (the launcher does
    that before any rank starts; the ranks check the space once they know the model's size)."""
    check_parent_exists(out, "--out")
    earlier = earlier_run_files(out) if need_bytes <= 0 else []
    if earlier:
        shown = ", ".join(earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
        raise UsageError(f"--out {out} already holds a tpprobe run ({shown}): a new run would overwrite or mix "
                         f"with it; choose a new folder (or leave --out out for a fresh one under {RUNS_DIR}/), "
                         f"or remove that run first")
    try:
        out.mkdir(exist_ok=True)
        probe = out / f".tpprobe-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror or e}; choose a writable folder")
    if need_bytes <= 0:
        return
    free = shutil.disk_usage(out).free
    need = int(need_bytes * 1.1) + HEADROOM
    if need > free:
        raise UsageError(f"--out {out} has {free / 1e6:.1f} MB free but this probe needs {need / 1e6:.1f} MB "
                         f"(about {need_bytes / 1e6:.1f} MB of captures + {HEADROOM >> 20} MB headroom); "
                         f"free space or choose another folder")


# -- reading ---------------------------------------------------------------------------------
@dataclass
class LoadedRank:
    """One rank read back from a capture folder (or posted by it live): its number, its record (rank-NNN.json
    read back as the RankRecord it was written as; a JSON object given here is read with RankRecord.from_json)
    and its tensors."""
    rank: int
    meta: RankRecord
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.meta, RankRecord):
            self.meta = RankRecord.from_json(self.meta)


@dataclass
class LoadedRun:
    path: Path
    manifest: dict
    records: dict[int, LoadedRank]
    problems: list[dict]          # {"file", "rank", "problem"} for every file that failed to verify


MAX_WORLD = 1 << 16          # a manifest claiming more ranks than this is refused, not iterated
MAX_JSON_BYTES = 256 << 20   # manifest / rank metadata larger than this is refused, not parsed


def _safe_member(root: Path, name) -> Path:
    """The file `name` of the manifest, inside `root`: relative, no `..`, no NUL, no symlink out."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\x00" in name \
            or len(name) > 1024 or ".." in Path(name).parts:
        raise CaptureError(f"{root / MANIFEST}: file path {str(name)[:80]!r} is not a plain relative name "
                           f"inside the capture folder; the manifest is corrupt or hostile, refused")
    try:
        p = (root / name).resolve()
        inside = root.resolve() in p.parents
    except (OSError, RuntimeError, ValueError) as e:
        raise CaptureError(f"{root / MANIFEST}: file path {name[:80]!r} cannot be resolved ({e}); refused")
    if not inside:
        raise CaptureError(f"{root / MANIFEST}: file path {name[:80]!r} leaves the capture folder; refused")
    return p


def _read_json(path: Path, what: str):
    """Parse a JSON file of the capture folder; CaptureError for anything unreadable."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CaptureError(f"{path}: {path.stat().st_size} bytes, more than a {what} can be; refused")
        return json.loads(path.read_bytes().decode("utf-8"))
    except CaptureError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CaptureError(f"{path}: not a readable {what} ({type(e).__name__}: {str(e)[:120]}); it is corrupt")


def safe_torch_load(path) -> object:
    """A `.pt` file of a capture folder, through the one loader (formats/safe_load.py): tensors and plain
    containers, never code.

    torch.load(weights_only=True) refuses any pickle that would import or call something; that
    refusal (and any other unreadable file) becomes one CaptureError naming the file."""
    p = Path(path)
    try:
        return torch_load(p)
    except pickle.UnpicklingError as e:
        from .safe_load import refusal
        raise CaptureError(refusal(p, e, "refused to load"))
    except Exception as e:   # truncated zip, not a torch file, ...: unreadable, never executed
        raise CaptureError(f"{p}: not a readable .pt file ({type(e).__name__}: {str(e)[:120]})")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors only (no pickle, no code); CaptureError for anything unreadable."""
    try:
        tensors = load_file(str(path))
    except Exception as e:   # SafetensorError, OSError, and whatever a hostile header provokes
        raise CaptureError(f"{path}: not a readable safetensors file ({type(e).__name__}: {str(e)[:160]})")
    return tensors


def read_manifest(root: Path) -> dict:
    mp = root / MANIFEST
    if not root.exists():
        raise CaptureError(f"{root}: no such file or folder; give a tpprobe capture folder (with {MANIFEST})")
    if not root.is_dir():
        raise CaptureError(f"{root}: not a folder; expected a tpprobe capture folder with {MANIFEST}")
    if not mp.is_file():
        raise CaptureError(f"{mp}: missing; expected a tpprobe capture folder (written by "
                           f"`tpprobe probe --out`, or a step of the SGLang or vLLM plugin)")
    manifest = _read_json(mp, "manifest")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise CaptureError(f"{mp}: schema {str(got)[:80]!r}, expected {SCHEMA!r}")
    files = manifest.get("files")
    ws = manifest.get("world_size")
    if not isinstance(files, list) or type(ws) is not int or not 1 <= ws <= MAX_WORLD:
        raise CaptureError(f"{mp}: needs 'files' (a list) and 'world_size' (an integer 1..{MAX_WORLD})")
    if not isinstance(manifest.get("settings", {}), dict):
        raise CaptureError(f"{mp}: 'settings' must be an object")
    for e in files:
        if not isinstance(e, dict) or type(e.get("size")) is not int or e["size"] < 0 \
                or not isinstance(e.get("sha256"), str) \
                or not (e.get("rank") is None or (type(e.get("rank")) is int and 0 <= e["rank"] < ws)):
            raise CaptureError(f"{mp}: file entry {str(e)[:80]!r} needs path, rank (None or 0..{ws - 1}), "
                               f"size (>= 0) and sha256")
        _safe_member(root, e.get("path"))
    return manifest


def load_run(path, verify: bool = True, manifest: Optional[dict] = None) -> LoadedRun:
    """Load every rank it can; `problems` names each file that is missing, extra or corrupt. `manifest`: the
    folder's manifest as read_manifest returned it, when the caller read it already."""
    root = Path(path)
    manifest = read_manifest(root) if manifest is None else manifest
    problems: list[dict] = []
    listed = set()
    ok_files: dict[str, dict] = {}
    for e in manifest["files"]:
        p = _safe_member(root, e["path"])
        listed.add(p.name)
        try:
            if not p.is_file():
                problems.append({"file": e["path"], "rank": e.get("rank"), "problem": "missing"})
            elif p.stat().st_size != e["size"]:
                problems.append({"file": e["path"], "rank": e.get("rank"),
                                 "problem": f"size {p.stat().st_size} bytes, manifest says {e['size']} (truncated or "
                                            f"replaced)"})
            elif verify and sha256_file(p) != e["sha256"]:
                problems.append({"file": e["path"], "rank": e.get("rank"),
                                 "problem": "sha256 differs from the manifest (corrupted)"})
            else:
                ok_files[e["path"]] = e
        except OSError as err:
            problems.append({"file": e["path"], "rank": e.get("rank"),
                             "problem": f"unreadable ({err.strerror or err})"})
    try:
        present = sorted(root.iterdir())
    except OSError as err:
        raise CaptureError(f"{root}: cannot list the folder ({err.strerror or err})")
    for p in present:
        if p.name not in listed and p.name not in (MANIFEST, "report.json") \
                and not p.name.startswith(".") and p.suffix in (".safetensors", ".json", ".pt") and p.is_file():
            problems.append({"file": p.name, "rank": None, "problem": "not in the manifest (extra file; ignored)"})

    records: dict[int, LoadedRank] = {}
    for rank in range(manifest["world_size"]):
        stem = rank_stem(rank)
        js, st = f"{stem}.json", f"{stem}.safetensors"
        if js not in ok_files:
            continue
        try:
            meta = RankRecord.from_json(_read_json(root / js, "rank metadata file"))
        except CaptureError as e:
            problems.append({"file": js, "rank": rank, "problem": f"unreadable JSON ({str(e).split(': ', 1)[-1]})"})
            continue
        except ValueError as e:
            problems.append({"file": js, "rank": rank, "problem": f"malformed rank metadata ({e})"})
            continue
        tensors: dict[str, torch.Tensor] = {}
        if st in ok_files:
            try:
                tensors = _load_tensors(root / st)
            except CaptureError as e:
                problems.append({"file": st, "rank": rank, "problem": str(e).split(": ", 1)[-1]})
                continue
        elif any(p["file"] == st for p in problems) or meta.extra.get("tensors_file", True):
            continue  # its tensors are unusable: do not report this rank from metadata alone
        records[rank] = LoadedRank(rank, meta, tensors)
    return LoadedRun(root, manifest, records, problems)


def load_rank_files(root: Path, rank: int, entries: list[dict]) -> LoadedRank:
    """One rank's record from its two files, verified against the entries it posted."""
    for e in entries:
        p = _safe_member(root, e["path"])
        try:
            same = p.is_file() and p.stat().st_size == e["size"] and sha256_file(p) == e["sha256"]
        except (OSError, KeyError, TypeError):
            same = False
        if not same:
            raise CaptureError(f"{p}: missing or differs from what rank {rank} reported writing")
    stem = rank_stem(rank)
    raw = _read_json(root / f"{stem}.json", "rank metadata file")
    try:
        meta = RankRecord.from_json(raw)
    except ValueError as e:
        raise CaptureError(f"{root / stem}.json: malformed rank metadata ({e})")
    return LoadedRank(rank, meta, _load_tensors(root / f"{stem}.safetensors"))


def point_set_mismatches(metas: dict[int, RankRecord]) -> list[dict]:
    """Where ranks disagree on what they captured: the set of capture points, or a point's shape
    or dtype. Read from each rank's metadata (not its tensors), so it holds also when the live
    exchange could gather only the points every rank has alike.

    Returns [{"point", "ranks" (the odd ones), "detail"}], the majority (ties: the lowest rank)
    taken as reference, one entry per disagreeing point."""
    sig = {r: {p.name: (list(p.shape), p.dtype) for p in m.points} for r, m in sorted(metas.items())}
    if len(sig) < 2:
        return []
    out = []
    names: list[str] = []
    for s in sig.values():
        names += [n for n in s if n not in names]
    for n in names:
        have = {r: s.get(n) for r, s in sig.items()}
        variants: dict = {}
        for r, v in have.items():
            variants.setdefault(repr(v), []).append(r)
        if len(variants) < 2:
            continue
        ref_key = max(variants, key=lambda k: (len(variants[k]), -min(variants[k])))
        ref = have[variants[ref_key][0]]
        odd = sorted(r for k, rs in variants.items() if k != ref_key for r in rs)

        def text(v):
            return "no such point" if v is None else f"shape {v[0]} {v[1]}"
        parts = [f"rank {r}: {text(have[r])}" for r in odd]
        out.append({"point": n, "ranks": odd,
                    "detail": f"ranks disagree on capture point {n}: {'; '.join(parts)}; the others "
                              f"({', '.join(map(str, variants[ref_key]))}): {text(ref)}"})
    return out


def estimate_capture_bytes(target, layer_ids: list[int], keep_all: bool) -> int:
    """What one rank writes: embedding (local + out), the kept layers, the packed aux, and with
    --exchange full every layer plus two tensors per audited all-reduce (about 2 per layer)."""
    per = int(target.input_ids.numel()) * target.hidden_size * torch.empty((), dtype=target.dtype).element_size()
    n = 3 + len(layer_ids) + len(layer_ids)
    if keep_all:
        n += target.num_layers + 2 * (2 * target.num_layers + 1)
    return n * per

