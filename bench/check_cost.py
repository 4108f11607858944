"""Check cost: `--exchange fingerprint` vs `--exchange full` through the real CLI.

    .venv/bin/python bench/check_cost.py [--nprocs 2,4] [--hidden 1024] [--tokens 1024]
        [--num-layers 4] [--iters 3] [--inject rank-noise@1] [--out DIR]

For each tp in --nprocs and each scenario (healthy; one diverging rank via --inject), runs
`tpprobe probe --exchange full|fingerprint ... --quiet --out D` alternately (full, fingerprint,
then fingerprint, full, ...), median of --iters, and reads D/report.json:
  moved      tensor bytes sent + received over all ranks (exchange.bytes_per_rank tensor_*),
             and all bytes incl. metadata (sent + received)
  % capt     moved / (captured bytes per rank x tp): the full run's captured_bytes_per_rank is
             every capture of a rank, the denominator for both modes
  ex+chk s   timings.exchange_s + timings.check_s (rank 0)
  rss0 MB    rank-0 peak RSS; extra0 = rank-0 peak RSS - rank-1 peak RSS, in captures
             (one capture = tokens x hidden x 4 bytes)
  findings   the finding kinds: the two modes must agree
Prints the table with fingerprint/full ratios and writes check_cost.json to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def probe(mode, nproc, a, inject, tmp):
    out = tempfile.mkdtemp(prefix=f"cc-{mode}-{nproc}-", dir=tmp)
    cmd = [sys.executable, "-m", "tpprobe", "probe", "--exchange", mode, "--nproc", str(nproc),
           "--hidden", str(a.hidden), "--tokens", str(a.tokens), "--num-layers", str(a.num_layers),
           "--ffn", "256", "--backend", "gloo", "--out", out, "--quiet", "--timeout", "300"]
    for i in inject:
        cmd += ["--inject", i]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    rep = json.load(open(os.path.join(out, "report.json")))
    ex = rep["exchange"]
    bpr = {int(r): v for r, v in ex["bytes_per_rank"].items()}
    tensor = sum(v["tensor_sent"] + v["tensor_received"] for v in bpr.values())
    alls = sum(v["sent"] + v["received"] for v in bpr.values())
    rss = {r: v["peak_rss_mb"] for r, v in bpr.items()}
    tm = rep["timings"]
    kinds = sorted({f["kind"] for f in rep["findings"]})
    subprocess.run(["rm", "-rf", out])
    return {"rc": p.returncode, "wall_s": wall, "tensor_moved": tensor, "all_moved": alls,
            "captured_per_rank": ex["captured_bytes_per_rank"], "exchange_check_s": tm["exchange_s"] + tm["check_s"],
            "exchange_s": tm["exchange_s"], "check_s": tm["check_s"], "forward_s": tm["forward_s"],
            "rss0_mb": rss.get(0), "rss1_mb": rss.get(1), "findings": kinds}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--inject", default="rank-noise@1", help="the diverging-rank scenario ('' = skip)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="check-cost-")
    cap = a.tokens * a.hidden * 4
    scen = [("healthy", [])] + ([(f"inject {a.inject}", [a.inject])] if a.inject else [])
    results = []
    for nproc in [int(x) for x in a.nprocs.split(",")]:
        for sname, inj in scen:
            runs = {"full": [], "fingerprint": []}
            for i in range(a.iters):
                for mode in (("full", "fingerprint") if i % 2 == 0 else ("fingerprint", "full")):
                    runs[mode].append(probe(mode, nproc, a, inj, tmp))
                    print(f"tp{nproc} {sname} {mode}: {runs[mode][-1]['exchange_check_s']:.3f} s", flush=True)
            row = {"tp": nproc, "scenario": sname}
            captured = runs["full"][0]["captured_per_rank"] * nproc
            for mode, rs in runs.items():
                med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
                row[mode] = {k: med(k) for k in ("tensor_moved", "all_moved", "exchange_check_s", "exchange_s",
                                                 "check_s", "forward_s", "rss0_mb", "rss1_mb", "wall_s")}
                row[mode]["pct_captured"] = 100 * row[mode]["all_moved"] / captured
                row[mode]["extra0_captures"] = (row[mode]["rss0_mb"] - row[mode]["rss1_mb"]) * 2 ** 20 / cap
                row[mode]["findings"] = rs[0]["findings"]
                row[mode]["rc"] = [r["rc"] for r in rs]
                row[mode]["all"] = rs
            row["captured_bytes_all_ranks"] = captured
            row["same_findings"] = row["full"]["findings"] == row["fingerprint"]["findings"]
            results.append(row)
    res = {"bench": "check_cost", "hidden": a.hidden, "tokens": a.tokens, "num_layers": a.num_layers,
           "iters": a.iters, "capture_bytes": cap, "backend": "gloo", "rows": results,
           "targets": {"pct_captured": "<= 1 %", "extra0_captures": "<= 2"}}
    print(f"\ncheck cost, gloo, hidden {a.hidden} tokens {a.tokens} layers {a.num_layers} "
          f"(one capture {cap / 1e6:.1f} MB), median of {a.iters}")
    hdr = (f"{'tp':>2} {'scenario':<20} {'mode':<11} {'moved MB':>9} {'% capt':>7} {'ex+chk s':>9} "
           f"{'rss0 MB':>8} {'extra0 capt':>11} {'findings'}")
    print(hdr)
    for row in results:
        for mode in ("full", "fingerprint"):
            r = row[mode]
            print(f"{row['tp']:>2} {row['scenario']:<20} {mode:<11} {r['all_moved'] / 1e6:>9.2f} "
                  f"{r['pct_captured']:>7.3f} {r['exchange_check_s']:>9.3f} {r['rss0_mb']:>8.0f} "
                  f"{r['extra0_captures']:>11.2f} {','.join(r['findings']) or '-'}")
        f, g = row["fingerprint"], row["full"]
        print(f"{'':>2} {'':<20} {'fp/full':<11} {f['all_moved'] / max(g['all_moved'], 1):>9.4f} {'':>7} "
              f"{f['exchange_check_s'] / g['exchange_check_s']:>9.3f} {f['rss0_mb'] / g['rss0_mb']:>8.3f} "
              f"{'':>11} same findings: {row['same_findings']}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "check_cost.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
