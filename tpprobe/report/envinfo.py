"""The environment header every report format carries: versions, backend, world, devices, topology.

`environment()` never raises: on CPU it says CPU; when NVML (nvidia-ml-py) is missing or cannot
start it falls back to what torch knows and records why under "nvml". The header describes the
machine rank 0 runs on (the report is built there); the ranks of that node map to its GPUs by
LOCAL_RANK, as the probe assigns them (`cuda:LOCAL_RANK`).
"""
from __future__ import annotations

import os
import re
import platform
from typing import Optional

from .. import __version__

# nvidia-smi topo -m vocabulary for NVML's common-ancestor levels
_TOPO = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_TOPO_WORDS = {"X": "same GPU", "PIX": "one PCIe switch", "PXB": "several PCIe switches",
               "PHB": "PCIe host bridge", "NODE": "same NUMA node, across host bridges",
               "SYS": "across NUMA nodes (SMP interconnect)"}


def _version(pkg: str) -> Optional[str]:
    try:
        import importlib.metadata as md
        return md.version(pkg)
    except Exception:
        return None


def _int_env(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _world() -> dict:
    out: dict = {}
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            out["world_size"] = dist.get_world_size()
            out["backend"] = str(dist.get_backend())
    except Exception:
        pass
    out.setdefault("world_size", _int_env("WORLD_SIZE"))
    rpn = _int_env("LOCAL_WORLD_SIZE")
    if rpn is None and out["world_size"] is not None and _int_env("GROUP_WORLD_SIZE") in (None, 1):
        rpn = out["world_size"]   # a single-node launch
    out["ranks_per_node"] = rpn
    if rpn and out["world_size"]:
        out["nodes"] = max(1, -(-out["world_size"] // rpn))
    return out


def _dec(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _nvml(local_ranks: int) -> dict:
    """NVML's view of this node's ranks' GPUs: names, memory, driver, NVLink / P2P between them."""
    try:
        import pynvml as nv
    except Exception as e:
        return {"nvml": f"unavailable: nvidia-ml-py not importable ({type(e).__name__})"}
    try:
        nv.nvmlInit()
    except Exception as e:
        return {"nvml": f"unavailable: {_dec(e) or type(e).__name__}"}
    try:
        info: dict = {"nvml": "ok"}
        try:
            info["driver"] = _dec(nv.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        try:
            v = nv.nvmlSystemGetCudaDriverVersion()
            info["cuda_driver"] = f"{v // 1000}.{(v % 1000) // 10}"
        except Exception:
            pass
        handles = _rank_handles(nv, local_ranks)
        gpus = []
        for rank, h in handles:
            g = {"rank": rank}
            for key, fn in (("name", lambda: _dec(nv.nvmlDeviceGetName(h))),
                            ("memory_gib", lambda: round(nv.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)),
                            ("uuid", lambda: _dec(nv.nvmlDeviceGetUUID(h))),
                            ("pci", lambda: _dec(nv.nvmlDeviceGetPciInfo(h).busId)),
                            ("index", lambda: nv.nvmlDeviceGetIndex(h))):
                try:
                    g[key] = fn()
                except Exception:
                    pass
            gpus.append(g)
        info["gpus"] = gpus
        if len(handles) > 1:
            info["topology"] = _topology(nv, handles, gpus)
        return info
    except Exception as e:   # never let the header break a report
        return {"nvml": f"error: {type(e).__name__}: {e}"}
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def _rank_handles(nv, local_ranks: int) -> list:
    """(local rank, NVML handle) for cuda:0..n-1 as torch numbers them (CUDA_VISIBLE_DEVICES aware)."""
    import torch
    out = []
    n = min(local_ranks, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    for r in range(n):
        h = None
        try:
            uuid = str(torch.cuda.get_device_properties(r).uuid)
            h = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid)
        except Exception:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(r)
            except Exception:
                h = None
        if h is not None:
            out.append((r, h))
    return out


def _topology(nv, handles: list, gpus: list) -> dict:
    """Pairwise link between the ranks' GPUs: NV<k> (k NVLinks), else the PCIe path; P2P read status."""
    bus = {r: g.get("pci", "").lower() for (r, _), g in zip(handles, gpus)}

    def norm(b: str) -> str:   # NVML pads the domain differently in places: compare the tail
        return b.lower()[-12:]

    nvlinks = {r: {} for r, _ in handles}
    active = {r: 0 for r, _ in handles}         # active links of each GPU
    to_switch = {r: 0 for r, _ in handles}      # ... of them ending at an NVSwitch (HGX boards)
    switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    for r, h in handles:
        for link in range(max_links):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except Exception:
                continue
            active[r] += 1
            try:
                if nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == switch_type:
                    to_switch[r] += 1
                    continue
            except Exception:
                pass
            try:
                remote = norm(_dec(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
            except Exception:
                continue
            for r2, b in bus.items():
                if r2 != r and b and norm(b) == remote:
                    nvlinks[r][r2] = nvlinks[r].get(r2, 0) + 1
    smi = None
    ranks = [r for r, _ in handles]
    matrix, pairs = [], []
    for i, (ra, ha) in enumerate(handles):
        row = []
        for j, (rb, hb) in enumerate(handles):
            if i == j:
                row.append("X")
                continue
            k = nvlinks[ra].get(rb, 0)
            if not k and to_switch[ra] and to_switch[rb] and _p2p(nv, ha, hb,
                                                                  "NVML_P2P_CAPS_INDEX_NVLINK") != "not supported":
                # through NVSwitches: the link nvidia-smi shows is NV<links of each GPU> (NV18, H100/H200)
                k = min(to_switch[ra], to_switch[rb])
            if not k:
                smi = _smi_topo() if smi is None else smi
                got = smi.get((_index(gpus, i), _index(gpus, j)), "")
                k = int(got[2:]) if got.startswith("NV") and got[2:].isdigit() else 0
            if k:
                link = f"NV{k}"
            else:
                try:
                    link = _TOPO.get(int(nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb)), "?")
                except Exception:
                    link = "?"
            row.append(link)
            if i < j:
                p2p = None
                try:
                    st = nv.nvmlDeviceGetP2PStatus(ha, hb, nv.NVML_P2P_CAPS_INDEX_READ)
                    p2p = "ok" if st == nv.NVML_P2P_STATUS_OK else "not supported"
                except Exception:
                    pass
                pairs.append({"ranks": [ra, rb], "link": link, "nvlinks": k, "p2p_read": p2p,
                              "meaning": f"{k} NVLink(s)" if k else _TOPO_WORDS.get(link, "unknown")})
        matrix.append(row)
    return {"ranks": ranks, "matrix": matrix, "pairs": pairs}


def _p2p(nv, ha, hb, cap: str) -> Optional[str]:
    try:
        st = nv.nvmlDeviceGetP2PStatus(ha, hb, getattr(nv, cap))
        return "ok" if st == nv.NVML_P2P_STATUS_OK else "not supported"
    except Exception:
        return None


def _index(gpus: list, i: int) -> int:
    g = gpus[i] if i < len(gpus) else {}
    return int(g.get("index", g.get("rank", i)))


def _smi_topo() -> dict:
    """{(gpu i, gpu j): "NV18" | "PHB" | ...} from `nvidia-smi topo -m` ({} when it cannot run):
    the fallback when NVML names no NVLink between two GPUs."""
    import shutil
    import subprocess
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return {}
    return parse_smi_topo(out)


def parse_smi_topo(text: str) -> dict:
    rows = [ln.split() for ln in text.splitlines() if ln.strip()]
    head = next((r for r in rows if r and r[0].startswith("GPU")), None)
    if head is None:
        return {}
    cols = [c for c in head if re.fullmatch(r"GPU\d+", c)]
    out = {}
    for r in rows:
        if r and re.fullmatch(r"GPU\d+", r[0]) and len(r) > len(cols):
            i = int(r[0][3:])
            for j, c in enumerate(cols):
                out[(i, int(c[3:]))] = r[1 + j]
    return out


def environment() -> dict:
    """The header: never raises. Keys absent when unknown; "devices" always a list of strings."""
    env: dict = {"tpprobe": __version__, "python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
        env["torch"] = torch.__version__
    except Exception:
        env["torch"] = None
        torch = None
    v = _version("sglang")
    if v:
        env["sglang"] = v
    env.update(_world())
    cuda = False
    try:
        cuda = bool(torch is not None and torch.cuda.is_available())
    except Exception:
        pass
    if torch is not None and torch.version.cuda:
        env["cuda"] = torch.version.cuda
    if cuda:
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        local = env.get("ranks_per_node") or torch.cuda.device_count()
        env.update(_nvml(local))
        if not env.get("gpus"):   # NVML could not tell: torch's names at least
            try:
                env["gpus"] = [{"rank": r, "name": torch.cuda.get_device_name(r),
                                "memory_gib": round(torch.cuda.get_device_properties(r).total_memory / 2**30, 1)}
                               for r in range(min(local, torch.cuda.device_count()))]
            except Exception:
                env["gpus"] = []
        env["devices"] = [f"{g.get('name', '?')} ({g.get('memory_gib', '?')} GiB)" for g in env["gpus"]] or ["CUDA"]
    else:
        env["device"] = "CPU"
        env["cpu"] = _cpu_name()
        env["cpu_count"] = os.cpu_count()
        env["devices"] = ["CPU"]
    return env


def env_lines(report_or_env: dict) -> list[str]:
    """The header as short plain lines (for the terminal and Markdown)."""
    e = report_or_env.get("environment", report_or_env) or {}
    st = report_or_env.get("settings", {}) if "environment" in report_or_env else {}
    ver = [f"tpprobe {e.get('tpprobe', '?')}", f"torch {e.get('torch', '?')}"]
    if e.get("sglang"):
        ver.append(f"sglang {e['sglang']}")
    ver.append(f"NCCL {e['nccl']}" if e.get("nccl") else "NCCL n/a")
    ver.append(f"python {e.get('python', '?')}")
    world = st.get("world_size", e.get("world_size"))
    backend = st.get("backend", e.get("backend"))
    w = f"backend {backend or '?'} · world {world if world is not None else '?'}"
    if e.get("ranks_per_node"):
        w += f" · {e['ranks_per_node']} ranks/node"
    if e.get("nodes") and e["nodes"] > 1:
        w += f" × {e['nodes']} nodes"
    lines = [" · ".join(ver), w]
    if e.get("gpus"):
        drv = f" · driver {e['driver']}" if e.get("driver") else ""
        names = {}
        for g in e["gpus"]:
            names.setdefault(f"{g.get('name', '?')} {g.get('memory_gib', '?')} GiB", []).append(g.get("rank"))
        lines.append("GPUs: " + "; ".join(f"rank {','.join(map(str, rs))}: {n}" for n, rs in names.items()) + drv)
        topo = e.get("topology")
        if topo and topo.get("pairs"):
            kinds: dict = {}
            for p in topo["pairs"]:
                kinds.setdefault(p["link"] + (" P2P" if p.get("p2p_read") == "ok" else ""), []).append(
                    f"{p['ranks'][0]}-{p['ranks'][1]}")
            lines.append("topology: " + "; ".join(f"{k} ({', '.join(v[:6])}{', …' if len(v) > 6 else ''})"
                                                  for k, v in kinds.items()))
        elif e.get("nvml") and e["nvml"] != "ok":
            lines.append(f"topology: unknown (NVML {e['nvml']})")
    else:
        cpu = e.get("cpu")
        lines[-1] += " · CPU" + (f" ({cpu}, {e.get('cpu_count')} cores)" if cpu else "")
    return lines


def env_line(report: dict) -> str:
    """One line for the terminal render's header."""
    return "  |  ".join(env_lines(report))
