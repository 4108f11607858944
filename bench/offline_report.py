"""Offline `tpprobe report DIR` vs simply reading the capture files.

    .venv/bin/python bench/offline_report.py [--dir DIR] [--hidden 2048] [--tokens 2048]
        [--num-layers 8] [--nproc 2] [--iters 3] [--out DIR]

Without --dir it first writes a capture folder with
`tpprobe probe --exchange full --backend gloo --hidden H --tokens N --num-layers L --nproc P`.
Then, alternately, median of --iters (page cache warm: one untimed pass of each first):
  raw        every *.safetensors file: safetensors.torch.load_file + hashlib.sha256 of its bytes
  report     `tpprobe report DIR --quiet` in this process (tpprobe.cli.report.report_dir)
  report-cli `python -m tpprobe report DIR --quiet` (adds interpreter start and imports)
throughput = bytes of the capture files / time; target: report >= 50 % of raw.
Writes offline_report.json to --out.
"""
import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench.harness import alternate, medians  # noqa: E402


def raw_read(files):
    from safetensors.torch import load_file
    for f in files:
        load_file(str(f))
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)


def report_inproc(d):
    from tpprobe.cli.report import report_dir
    with contextlib.redirect_stdout(io.StringIO()):
        report_dir(Path(d), quiet=True)


def report_cli(d):
    subprocess.run([sys.executable, "-m", "tpprobe", "report", str(d), "--quiet"], cwd=ROOT,
                   capture_output=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    made = None
    d = a.dir
    if d is None:
        made = tempfile.mkdtemp(prefix="offline-report-")
        d = os.path.join(made, "run")
        cmd = [sys.executable, "-m", "tpprobe", "probe", "--exchange", "full", "--backend", "gloo",
               "--hidden", str(a.hidden), "--tokens", str(a.tokens), "--num-layers", str(a.num_layers),
               "--nproc", str(a.nproc), "--out", d, "--quiet", "--timeout", "600"]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not (Path(d) / "manifest.json").exists():
            sys.exit(f"probe failed (rc {p.returncode}): {p.stderr[-2000:]}")
        print(f"wrote {d} in {time.time() - t0:.1f} s", flush=True)
    files = sorted(Path(d).rglob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    variants = {"raw": lambda: raw_read(files), "report": lambda: report_inproc(d),
                "report-cli": lambda: report_cli(d)}
    names = list(variants)

    def run(v):
        t0 = time.perf_counter()
        variants[v]()
        return time.perf_counter() - t0

    times = alternate(names, run, a.iters, warmup=1)    # warm-up: the page cache and the imports
    med = medians(times)
    rows = [{"variant": v, "median_s": med[v], "MBps": nbytes / med[v] / 1e6,
             "frac_of_raw": med["raw"] / med[v], "all_s": times[v]} for v in names]
    res = {"bench": "offline_report", "dir": d, "files": len(files), "bytes": nbytes, "iters": a.iters,
           "hidden": a.hidden, "tokens": a.tokens, "num_layers": a.num_layers, "nproc": a.nproc,
           "rows": rows, "target": "report >= 50 % of raw throughput"}
    print(f"offline report: {len(files)} files, {nbytes / 1e6:.0f} MB, median of {a.iters}")
    print(f"{'variant':<11} {'median s':>9} {'MB/s':>8} {'% of raw':>9}")
    for r in rows:
        print(f"{r['variant']:<11} {r['median_s']:>9.3f} {r['MBps']:>8.0f} {100 * r['frac_of_raw']:>8.1f}%")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "offline_report.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    if made:
        shutil.rmtree(made)


if __name__ == "__main__":
    main()
