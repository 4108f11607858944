"""tpprobe vs SGLang's comparator on identical SGLang dumper folders.

    PYTHONPATH=/tmp/polars .venv/bin/python bench/dumper_vs_comparator.py [--tokens 8192] [--hidden 7168]
        [--dir DIR] [--out DIR] [--skip-kimi] [--skip-verdicts] [--reuse] [--repeat 3] [--skip-comparator]

The comparator needs `polars`, which tpprobe's environment does not have and must not get. Install
it to a side folder for this benchmark only and pass it on PYTHONPATH (only the comparator's
subprocess is given it):

    .venv/bin/python -m pip install --target /tmp/polars polars

Dumps are written by SGLang's own dumper (`sglang.srt.debug_utils.dumper.dumper.dump`) on real gloo
ranks with SGLang's parallel state published (tests/helpers/dumper_ranks.py for the verdict cases, `_kimi`
below for the large one): a baseline run at tp 1 and a target run at tp 2, the same tokens.

1. Verdicts (16 tokens × 32, bf16):
   partial  the target's embedding is each rank's vocab-parallel partial (rows of tokens outside the
            rank's vocab shard are zero), its dims say `t h # tp:replicated` (what SGLang's own
            embedding dump would be labelled), baseline the full embedding
   ulp      a replicated hidden state (dims `t h # tp:replicated`); target rank 1 differs from rank 0
            by 1 ULP in every 7th element, rank 0 equals the baseline
   ulp_bare the same without dims
   Both tools run on each: the comparator (`--baseline-path B --target-path T`), `tpprobe diff B T`
   and `tpprobe report T`; the table shows each tool's verdict and exit status.
   round trip: a target with no dims at all (partial embedding, dense partial, TP slice, 1-ULP
   replicated); the comparator alone, then with `--override-config` = `tpprobe report T --emit-dims`.
2. Kimi width (hidden 7168, bf16, 8192 tokens; 4 tensors; tp 1 baseline + tp 2 target = 12 files of
   117 MB = 1.41 GB): embed (target: vocab-parallel partial, dims `t h[tp:partial]`), hidden
   (replicated, bitwise), attn_out (replicated; 1-ULP noise between the ranks and against the
   baseline), mlp_out (target: two dense partial sums, dims `t h[tp:partial]`). Each command runs
   in a fresh process (page cache warm: one untimed raw read first) and is timed wall-clock with
   its peak RSS (wait4's ru_maxrss):
     raw         python: torch.load(weights_only=True) of every file, one at a time (raw target: the
                 target folder's files only, what `report T` reads)
     raw mmap    the same with mmap=True and one pass over every byte (uint8 max): the floor for a
                 reader that maps the files, as tpprobe does
     comparator  sglang.srt.debug_utils.comparator's run(parse_args([--baseline-path B --target-path T ...]))
     tpprobe     tpprobe.cli.main(["diff", B, T, "--json"]) / main(["report", T, "--json"])
   Each is reported twice: the work alone (after the imports, timed inside the process) and the
   whole process (interpreter start and imports included), each in wall-clock seconds and in CPU
   seconds (user + system: less sensitive to a busy machine), all as × the raw read of the same
   files (diff: both folders; report: the target's). --repeat N rounds (default 3), each side by
   side; the comparator (~1 min, 3.9 GB) runs in the first round only (--skip-comparator: never).
   Targets: tpprobe ≤ 1.2 × raw and ≤ 1 GB peak RSS, no false alarm on the noise.
Writes dumper_vs_comparator.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


# ---- the Kimi-width dumps (written on the ranks) ----------------------------------------------------
def _kimi(ctx, base: str, exp: str, tokens: int, hidden: int, vocab: int = 163840) -> dict:
    import torch

    from tpprobe.engines.sglang.dist import publish_parallel_state
    publish_parallel_state(ctx.rank, ctx.world_size, ctx.local_rank, "gloo", "cpu")
    from sglang.srt.debug_utils.dumper import dumper

    tp, rank = ctx.world_size, ctx.rank
    dumper.configure(enable=True, dir=base, exp_name=exp, enable_output_console=False)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    dumper.dump("input_ids", ids)
    # embedding rows: a seeded row per token id (the full table would be 2.3 GB)
    rows = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    if tp == 1:
        dumper.dump("embed", rows)
    else:
        per = (vocab + tp - 1) // tp
        mine = (ids >= rank * per) & (ids < (rank + 1) * per)
        dumper.dump("embed", rows * mine[:, None].to(rows.dtype), dims="t h[tp:partial]")
    del rows
    h = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    dumper.dump("hidden", h, **({"dims": "t h # tp:replicated"} if tp > 1 else {}))
    a = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    if tp > 1:
        bits = a.view(-1).view(torch.int16)
        bits[rank::7] += 1                   # 1 ULP: rank r moves elements r, r+7, ... (and the baseline none)
    dumper.dump("attn_out", a, **({"dims": "t h # tp:replicated"} if tp > 1 else {}))
    del a, h
    p = [torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(20 + r)).to(torch.bfloat16)
         for r in range(2)]
    if tp == 1:
        dumper.dump("mlp_out", p[0] + p[1])
    else:
        dumper.dump("mlp_out", p[rank], dims="t h[tp:partial]")
    dumper.step()
    dumper.configure(enable=False)
    return {"rank": rank}


# ---- measuring ------------------------------------------------------------------------------------
def run_one(cmd: list[str], env: dict | None = None) -> dict:
    """Run cmd in a fresh process and report its own peak RSS (via a tiny wrapper that calls wait4)."""
    wrapper = ("import os,sys,json,time,subprocess;t=time.perf_counter();p=subprocess.Popen(sys.argv[1:],"
               "stdout=open(os.environ['BENCH_OUT'],'wb'),stderr=open(os.environ['BENCH_ERR'],'wb'));"
               "_,st,ru=os.wait4(p.pid,0);print(json.dumps({'wall_s':time.perf_counter()-t,"
               "'rc':os.waitstatus_to_exitcode(st),'maxrss_mb':ru.ru_maxrss/1024,'cpu_s':ru.ru_utime+ru.ru_stime}))")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        e = dict(os.environ)
        e.pop("PYTHONPATH", None)
        e.update(env or {})
        e["BENCH_OUT"], e["BENCH_ERR"] = f"{tmp}/out", f"{tmp}/err"
        r = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=e, cwd=ROOT)
        res = json.loads(r.stdout)
        res["stdout"] = Path(f"{tmp}/out").read_text(errors="replace")
        res["stderr"] = Path(f"{tmp}/err").read_text(errors="replace")[-1500:]
    res["cmd"] = " ".join(cmd[3:])
    res["work_s"] = work_s(res)
    res["work_cpu_s"] = work_s(res, cpu=True)
    return res


# every command runs in a fresh interpreter through one of these: imports first, then the work is timed
# (WORK_S on stderr); the wrapper around it times the whole process and reads its peak RSS
RAW = ("import sys,time,torch,pathlib\n"
       "t, c = time.perf_counter(), time.process_time()\n"
       "for d in sys.argv[1:]:\n"
       "    for f in sorted(pathlib.Path(d).glob('*.pt')):\n"
       "        x = torch.load(str(f), weights_only=True); del x\n"
       "sys.stderr.write(f'WORK_S={time.perf_counter() - t} {time.process_time() - c}\\n')\n")
RAWMAP = ("import sys,time,torch,pathlib\n"
          "t, c = time.perf_counter(), time.process_time()\n"
          "for d in sys.argv[1:]:\n"
          "    for f in sorted(pathlib.Path(d).glob('*.pt')):\n"
          "        x = torch.load(str(f), weights_only=True, mmap=True)['value']\n"
          "        x.contiguous().reshape(-1).view(torch.uint8).max(); del x\n"
          "sys.stderr.write(f'WORK_S={time.perf_counter() - t} {time.process_time() - c}\\n')\n")
CMP = ("import sys,time\n"
       "from sglang.srt.debug_utils.comparator.entrypoint import parse_args, run\n"
       "a = parse_args(sys.argv[1:])\n"
       "t, c = time.perf_counter(), time.process_time()\n"
       "try:\n"
       "    rc = run(a)\n"
       "finally:\n"
       "    sys.stderr.write(f'WORK_S={time.perf_counter() - t} {time.process_time() - c}\\n')\n"
       "sys.exit(rc)\n")
TPP = ("import sys,time\n"
       "from tpprobe.cli import main\n"
       "import tpprobe.dumpdir.report\n"
       "t, c = time.perf_counter(), time.process_time()\n"
       "try:\n"
       "    main(sys.argv[1:])\n"
       "finally:\n"
       "    sys.stderr.write(f'WORK_S={time.perf_counter() - t} {time.process_time() - c}\\n')\n")


def work_s(res: dict, cpu: bool = False):
    """The work's wall seconds (or CPU seconds, user + system, with cpu) as the script printed them."""
    for line in reversed(res["stderr"].splitlines()):
        if line.startswith("WORK_S="):
            return float(line[7:].split()[1 if cpu else 0])
    return None


def comparator_cmd(b, t) -> list[str]:
    return [sys.executable, "-c", CMP, "--baseline-path", str(b), "--target-path",
            str(t), "--report-path", "", "--output-format", "json", "--verbosity", "minimal"]


def comparator_verdict(res: dict) -> dict:
    out = {"rc": res["rc"], "failed": [], "passed": [], "replicated_check_failed": [], "summary": None}
    for line in res["stdout"].splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("type") == "comparison_tensor":
            ok = (d.get("diff") or {}).get("passed")
            (out["passed"] if ok else out["failed"]).append(d["name"])
            bad = [c for c in d.get("replicated_checks") or [] if not c.get("passed")]
            if bad:
                out["replicated_check_failed"].append(
                    f"{d['name']}: axis {bad[0]['axis']} rank {bad[0]['compared_index']} vs {bad[0]['baseline_index']} "
                    f"max_abs {bad[0]['diff']['max_abs_diff']:.3g} > atol {bad[0]['atol']:g}")
            if d.get("errors"):
                out.setdefault("errors", []).extend(str(x)[:160] for x in d["errors"])
        elif d.get("type") == "comparison_skip":
            out.setdefault("skipped", []).append(f"{d.get('name')}: {d.get('reason')}")
        elif d.get("type") == "summary":
            out["summary"] = {k: d[k] for k in ("total", "passed", "failed", "skipped", "errored")}
    return out


def tpprobe_cmd(*args) -> list[str]:
    return [sys.executable, "-c", TPP, *map(str, args)]


def tpprobe_verdict(res: dict) -> dict:
    try:
        d = json.loads(res["stdout"])
    except ValueError:
        return {"rc": res["rc"], "error": res["stderr"].strip()[-300:]}
    return {"rc": res["rc"], "findings": [f["line"] for f in d.get("findings", [])],
            "levels": {r["name"]: r["level"] for r in d.get("rows", [])} or
            {r["name"]: r["read"] for r in d.get("records", [])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dir", default="/tmp/tpprobe-bench-dumper")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--skip-kimi", action="store_true")
    ap.add_argument("--skip-verdicts", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep existing dumps in --dir")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the Kimi-width timings (each side by side)")
    ap.add_argument("--skip-comparator", action="store_true", help="time tpprobe and the raw reads only")
    a = ap.parse_args()
    polars = os.environ.get("PYTHONPATH", "")
    cmp_env = {"PYTHONPATH": polars}
    tp_env = {"PYTHONPATH": str(ROOT)}
    base = Path(a.dir)
    from helpers.sglang_ranks import run_ranks
    results: dict = {"verdicts": {}, "kimi": None}

    # 1. verdicts
    S = lambda n, recs: {"tokens": n, "records": recs}  # noqa: E731
    tiny = base / "tiny"
    if a.skip_verdicts:
        pass
    elif not (a.reuse and tiny.exists()):
        shutil.rmtree(tiny, ignore_errors=True)
        run_ranks("helpers.dumper_ranks:write", 2, {"base": str(tiny / "tp2"), "exps": {
            "partial": [S(16, [("input_ids", "input_ids", None), ("embed", "embed_part", "t h # tp:replicated")])],
            "ulp": [S(16, [("input_ids", "input_ids", None), ("h", "ulp", "t h # tp:replicated")])],
            "ulp_bare": [S(16, [("input_ids", "input_ids", None), ("h", "ulp", None)])]}}, 300)
        run_ranks("helpers.dumper_ranks:write", 1, {"base": str(tiny / "tp1"), "exps": {
            "partial": [S(16, [("input_ids", "input_ids", None), ("embed", "embed", None)])],
            "ulp": [S(16, [("input_ids", "input_ids", None), ("h", "full", None)])],
            "ulp_bare": [S(16, [("input_ids", "input_ids", None), ("h", "full", None)])]}}, 300)
    # the round trip: no dims in the dumps; tpprobe's --emit-dims handed to the comparator
    bare = tiny / "bare"
    if not (a.reuse and bare.exists()):
        shutil.rmtree(bare, ignore_errors=True)
        run_ranks("helpers.dumper_ranks:write", 2, {"base": str(bare / "tp2"), "exps": {"run": [S(16, [
            ("input_ids", "input_ids", None), ("embed", "embed_part", None), ("o_proj", "row_part", None),
            ("qkv", "shard", None), ("h", "ulp", None)])]}}, 300)
        run_ranks("helpers.dumper_ranks:write", 1, {"base": str(bare / "tp1"), "exps": {"run": [S(16, [
            ("input_ids", "input_ids", None), ("embed", "embed", None), ("o_proj", "row_full", None),
            ("qkv", "full", None), ("h", "full", None)])]}}, 300)
    b, t = bare / "tp1" / "run", bare / "tp2" / "run"
    if a.skip_verdicts:
        pass
    else:
        _verdicts(a, results, tiny, b, t, base, cmp_env, tp_env)
    _kimi_runs(a, results, base, cmp_env, tp_env, run_ranks)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "dumper_vs_comparator.json").write_text(json.dumps(results, indent=1))


def _verdicts(a, results, tiny, b, t, base, cmp_env, tp_env) -> None:
    em = run_one(tpprobe_cmd("report", t, "--emit-dims"), tp_env)
    yml = base / "emitted-dims.yaml"
    yml.write_text(em["stdout"])
    results["emit_dims"] = {"yaml": em["stdout"],
                            "comparator without dims": comparator_verdict(run_one(comparator_cmd(b, t), cmp_env)),
                            "comparator with tpprobe's dims": comparator_verdict(run_one(
                                comparator_cmd(b, t) + ["--override-config", str(yml)], cmp_env)),
                            "tpprobe diff": tpprobe_verdict(run_one(tpprobe_cmd("diff", b, t, "--json"), tp_env))}
    print(json.dumps({"emit_dims": results["emit_dims"]}, indent=1), flush=True)
    for case in ("partial", "ulp", "ulp_bare"):
        b, t = tiny / "tp1" / case, tiny / "tp2" / case
        results["verdicts"][case] = {
            "comparator": comparator_verdict(run_one(comparator_cmd(b, t), cmp_env)),
            "tpprobe diff": tpprobe_verdict(run_one(tpprobe_cmd("diff", b, t, "--json"), tp_env)),
            "tpprobe report": tpprobe_verdict(run_one(tpprobe_cmd("report", t, "--json"), tp_env))}
        print(json.dumps({case: results["verdicts"][case]}, indent=1), flush=True)


def _kimi_runs(a, results, base, cmp_env, tp_env, run_ranks) -> None:
    if not a.skip_kimi:
        kimi = base / "kimi"
        if not (a.reuse and (kimi / "tp2" / "run").exists()):
            shutil.rmtree(kimi, ignore_errors=True)
            for w in (1, 2):
                run_ranks("dumper_vs_comparator:_kimi", w, {"base": str(kimi / f"tp{w}"), "exp": "run",
                                                             "tokens": a.tokens, "hidden": a.hidden}, 900,
                          env={"PYTHONPATH": str(ROOT / "bench")})
        b, t = kimi / "tp1" / "run", kimi / "tp2" / "run"
        files = sorted(b.glob("*.pt")) + sorted(t.glob("*.pt"))
        size = sum(f.stat().st_size for f in files)
        raw = [sys.executable, "-c", RAW, str(b), str(t)]
        run_one(raw)                                      # page cache warm, untimed
        results["kimi"] = {"files": len(files), "bytes": size, "tokens": a.tokens, "hidden": a.hidden, "repeats": [],
                           "cpus": os.cpu_count(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        for rep in range(a.repeat):
            # side by side in one round; `report T` reads the target's files only, so its ratio is
            # taken against a raw read of those (raw target); `diff` reads both folders (raw)
            runs = {"raw": run_one(raw), "raw target": run_one([sys.executable, "-c", RAW, str(t)]),
                    "raw mmap": run_one([sys.executable, "-c", RAWMAP, str(b), str(t)]),
                    "raw mmap target": run_one([sys.executable, "-c", RAWMAP, str(t)])}
            if not a.skip_comparator and rep == 0:
                runs["comparator"] = run_one(comparator_cmd(b, t), cmp_env)
            runs["tpprobe diff"] = run_one(tpprobe_cmd("diff", b, t, "--json"), tp_env)
            runs["tpprobe report"] = run_one(tpprobe_cmd("report", t, "--json"), tp_env)
            results["kimi"]["repeats"].append(_round(runs, os.getloadavg()))
            print(json.dumps(results["kimi"]["repeats"][-1], indent=1), flush=True)


def _round(runs: dict, load) -> dict:
    """One round's rows; each × raw against the raw read of the same files (report: the target's)."""
    out = {"loadavg": [round(x, 2) for x in load], "runs": {}, "verdicts": {}}
    for k, v in runs.items():
        base = "raw target" if k in ("tpprobe report", "raw target") else "raw"
        mbase = "raw mmap target" if base == "raw target" else "raw mmap"
        rw, rk, mk = runs[base]["wall_s"], runs[base]["work_s"], runs[mbase]["work_s"]
        out["runs"][k] = {"process_s": round(v["wall_s"], 2), "process_x_raw": round(v["wall_s"] / rw, 2),
                          "work_s": round(v["work_s"], 3) if v["work_s"] else None,
                          "work_x_raw": round(v["work_s"] / rk, 2) if v["work_s"] else None,
                          "work_x_raw_mmap": round(v["work_s"] / mk, 2) if v["work_s"] else None,
                          "work_cpu_s": round(v["work_cpu_s"], 3) if v["work_cpu_s"] else None,
                          "work_cpu_x_raw": round(v["work_cpu_s"] / runs[base]["work_cpu_s"], 2) if v["work_cpu_s"]
                          else None,
                          "process_cpu_s": round(v["cpu_s"], 2),
                          "process_cpu_x_raw": round(v["cpu_s"] / runs[base]["cpu_s"], 2),
                          "against": base, "maxrss_mb": round(v["maxrss_mb"]), "rc": v["rc"], "args": v["cmd"]}
    for k in ("comparator", "tpprobe diff", "tpprobe report"):
        if k in runs:
            out["verdicts"][k] = (comparator_verdict if k == "comparator" else tpprobe_verdict)(runs[k])
    return out


if __name__ == "__main__":
    main()
