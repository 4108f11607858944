"""The watch (TPPROBE_WATCH=N) in the SGLang plugin, loaded through SGLang's own load_plugins() in two real gloo ranks
running SGLang's Llama on CPU (tpprobe.engines.sglang.tiny, as tests/engines/sglang/test_sglang_plugin.py): one
forward in N checked on both ranks; a reduce SGLang's GroupCoordinator returns scaled on rank 1 in one call is named
at its step, layer and rank in one log line and by `tpprobe report`; the live toggle through SGLang's RPC hook
(`Scheduler.handle_rpc_request`, as `Engine.collective_rpc("tpprobe_watch", n=...)` reaches it); a fault in the
watch's own code on one rank stops the watch on both, and every forward still returns.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.sglang_ranks import LAST_LOGS, run_ranks
from tpprobe.engines.sglang import INSTALL_HINT, available

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not available(), reason=f"sglang not installed: {INSTALL_HINT}")]

L, TOKENS, SEED = 3, 6, 5


def once_wrong(bad_rank: int, bad_call: int, rank: int) -> dict:
    """SGLang's TP GroupCoordinator returns the sum x 2 on `bad_rank` in its `bad_call`-th all-reduce (0-based),
    and in the 2nd all-reduce of every forward the worker arms (`calls["armed"]`)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator, get_tp_group

    tp, orig = get_tp_group(), GroupCoordinator.__dict__["all_reduce"]
    calls = {"n": 0, "k": 0, "armed": False}

    def all_reduce(self, input_, *a, **kw):
        out = orig(self, input_, *a, **kw)
        if self is tp and isinstance(input_, torch.Tensor):
            if rank == bad_rank and (calls["n"] == bad_call or calls["armed"] and calls["k"] == 1):
                out = out * 2
            calls["n"] += 1
            calls["k"] += 1
        return out

    GroupCoordinator.all_reduce = all_reduce
    return calls


def worker(ctx, forwards, bad_call=None, toggles=None, bad_forwards=()):
    from tpprobe.engines.sglang import cpu_mode

    cpu_mode.enable()
    from sglang.srt.plugins import load_plugins

    load_plugins()       # what each SGLang scheduler (TP rank worker) process does first
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.managers.io_struct import RpcReqInput

    from tpprobe.engines import watch
    from tpprobe.engines.sglang.watch import handle_rpc
    from tpprobe.engines.sglang.tiny import build_target

    t = build_target(ctx, "llama", L, TOKENS, SEED, torch.float32, [0, 1])
    calls = once_wrong(1, -1 if bad_call is None else bad_call, ctx.rank)
    outs, rpc = [], []

    class Sched:            # what SGLang's handle_rpc_request reads of its scheduler: the TP group
        tp_group = get_tp_group()

    def sglangs_own(scheduler, req):
        raise AssertionError(f"{req.method} reached SGLang's handler")
    for i in range(forwards):
        # the AROUND hook the plugin registers on Scheduler.handle_rpc_request (SGLang's scheduler module does
        # not import in the CPU tier: no setproctitle), called with SGLang's own request as the RPC path sends it
        if toggles and i in toggles:
            out = handle_rpc(sglangs_own, Sched(), RpcReqInput(method="tpprobe_watch", parameters={"n": toggles[i]}))
            rpc.append((out.success, json.loads(out.message)["every"]))
        calls.update(k=0, armed=i in bad_forwards)
        outs.append(t.forward())
    watch.flush(force=True)
    return {"status": watch.status(), "calls": calls["n"], "rpc": rpc, "kinds": [type(o).__name__ for o in outs]}


def _report(*dirs, json_out=True):
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", *map(str, dirs)] + (["--json"] if json_out else []),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout) if json_out else p.stdout


def _env(tmp_path, every):
    return {"TPPROBE_CAPTURE_DIR": str(tmp_path), "SGLANG_PLUGINS": "tpprobe", "TPPROBE_WATCH": str(every)}


def test_one_wrong_reduce_in_a_checked_forward_is_named_at_its_step_layer_and_rank(tmp_path):
    """Forwards 0..7 at TPPROBE_WATCH=2; the 2nd reduce of forward 4 (layer 0's o_proj: the embedding's is the
    1st) returns the sum x 2 on rank 1: forward 4 is the one failing step; 0, 2 and 6 (the same input, no KV
    cache in between) are healthy."""
    per_forward = run_ranks(f"{__name__}:worker", 2, dict(forwards=1), env=_env(tmp_path / "count", 1),
                            timeout=240)[0]["calls"]
    res = run_ranks(f"{__name__}:worker", 2, dict(forwards=8, bad_call=4 * per_forward + 1),
                    env=_env(tmp_path / "w", 2), timeout=240)
    log = "".join(LAST_LOGS)
    lines = [x[x.index("[tpprobe] step"):] for x in log.splitlines() if "[tpprobe] step" in x]
    assert lines and lines[0].startswith("[tpprobe] step 4 (extend): allreduce-incomplete at layer 0 (") \
        and " on rank 1: " in lines[0], lines or log[-3000:]
    st = res[0]["status"]
    assert (st["every"], st["checked"], st["healthy"], st["first_step"], st["last_step"]) == (2, 4, 3, 0, 6), st
    assert st["findings"][0]["step"] == 4 and st["findings"][0]["ranks"] == [1], st
    code, rep = _report(tmp_path / "w")
    assert code == 1 and rep["watch"]["healthy"] == 3 and rep["watch"]["checked"] == 4, rep["watch"]
    assert [s["step"] for s in rep["watch"]["failing_steps"]] == [4], rep["watch"]
    first = rep["watch"]["failing_steps"][0]
    assert (first["step"], first["first"]["kind"], first["first"]["ranks"]) == (4, "allreduce-incomplete", [1]), first
    assert first["first"]["where"].startswith("layer 0 ("), first
    assert res[0]["kinds"] == res[1]["kinds"] and len(res[0]["kinds"]) == 8
    _per_node_folders_merge(tmp_path, first)


def _per_node_folders_merge(tmp_path, first):
    """The same run as two nodes would have written it with no shared filesystem (each rank its own files and
    summary, TP rank 0 the manifest): `tpprobe report NODE0 NODE1` is the one-folder report, and says which ranks
    each folder held; one node's folder alone names the missing rank's files."""
    import shutil

    src = tmp_path / "w" / "dp0-pp0"
    nodes = [tmp_path / f"node{r}" / "dp0-pp0" for r in (0, 1)]
    for r, node in enumerate(nodes):
        for f in src.rglob("*"):
            if f.is_file() and (f"rank-{r:03d}" in f.name or (r == 0 and f.name == "manifest.json")):
                (node / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, node / f.relative_to(src))
    code, rep = _report(*(n.parent for n in nodes))
    assert code == 1 and rep["watch"]["failing_steps"][0] == first, rep["watch"]
    assert {k: v["ranks"] for k, v in rep["watch"]["folders"].items()} == \
        {str(nodes[0].parent): [0], str(nodes[1].parent): [1]}, rep["watch"]["folders"]
    code, text = _report(*(n.parent for n in nodes), json_out=False)
    assert f"{nodes[0].parent}: ranks [0]; {nodes[1].parent}: ranks [1]" in " ".join(text.split()), text
    code, rep = _report(nodes[0].parent)
    assert code == 1 and any("no summary of rank(s) [1]" in n for n in rep["watch"]["notes"]), rep["watch"]
    assert rep["watch"]["failing_steps"][0]["first"]["kind"] == "capture-file", rep["watch"]


def test_watch_toggled_through_sglangs_rpc_hook_is_healthy_with_full_counts(tmp_path):
    """TPPROBE_WATCH unset at start (the plugin on for its capture folder only), turned on at forward 2 with
    n=1 and off at forward 5 through SGLang's RPC handler: forwards 2, 3, 4 checked and healthy."""
    env = {**_env(tmp_path, 0), "TPPROBE_WATCH": "0", "TPPROBE_MAX_STEPS": "0"}
    res = run_ranks(f"{__name__}:worker", 2, dict(forwards=7, toggles={2: 1, 5: 0}), env=env, timeout=240)
    for r in res:
        assert r["rpc"] == [(True, 1), (True, 0)], r["rpc"]
        st = r["status"]
        assert (st["checked"], st["healthy"], st["failing"], st["first_step"], st["last_step"], st["stopped"]) == \
            (3, 3, 0, 2, 4, None), st
        assert (st["warned"], st["warning"]) == (0, None), st         # healthy = no finding at all: full coverage
    code, text = _report(tmp_path, json_out=False)
    assert code == 0 and "3 forward(s) checked, 3 healthy, 0 failing" in " ".join(text.split()), text


def test_a_fault_in_the_watch_on_one_rank_stops_it_on_both_and_the_forwards_go_on(tmp_path):
    env = {**_env(tmp_path, 1), "TPPROBE_VLLM_INJECT": "plugin-error@1"}
    res = run_ranks(f"{__name__}:worker", 2, dict(forwards=4), env=env, timeout=240)
    log = "".join(LAST_LOGS)
    lines = [x for x in log.splitlines() if "watch FAILED" in x]
    assert len(lines) == 1 and "at step 0 (extend) on tp rank(s) [1]" in lines[0], lines or log[-3000:]
    for r in res:
        assert r["status"]["stopped"] and r["status"]["checked"] == 0 and len(r["kinds"]) == 4, r


def test_failing_records_past_max_bytes_are_counted_not_kept(tmp_path):
    """TPPROBE_MAX_BYTES=50000 per rank holds one failing forward's record (~31 KB a rank), not two: forwards 1 and
    2 both fail, the first is kept, the second is counted and listed, and the report names both."""
    env = {**_env(tmp_path, 1), "TPPROBE_MAX_BYTES": "50000"}
    res = run_ranks(f"{__name__}:worker", 2, dict(forwards=4, bad_forwards=(1, 2)), env=env, timeout=240)
    st = res[0]["status"]
    assert (st["checked"], st["healthy"], st["failing"], st["not_kept"]) == (4, 2, 2, 1), st
    assert [(f["step"], f["folder"] is not None) for f in st["findings"]] == [(1, True), (2, False)], st
    assert [p.name for p in sorted((tmp_path / "dp0-pp0").glob("step-*"))] == ["step-000001-extend"]
    log = "".join(LAST_LOGS)
    assert "[tpprobe] step 2 (extend): allreduce-incomplete" in log and "(record not kept: TPPROBE_MAX_BYTES" in log
    code, rep = _report(tmp_path)
    assert code == 1 and [s["step"] for s in rep["watch"]["failing_steps"]] == [1, 2], rep["watch"]
    assert rep["watch"]["not_kept"] == 1, rep["watch"]


def test_a_one_rank_watch_is_not_checked_across_ranks_never_healthy(tmp_path):
    """tp 1: each checked forward has no peer to agree with and no all-reduce to check, so the report says so (exit
    0), as a one-rank probe does, and never HEALTHY."""
    res = run_ranks(f"{__name__}:worker", 1, dict(forwards=3), env=_env(tmp_path, 1), timeout=240)
    st = res[0]["status"]
    assert (st["checked"], st["healthy"], st["failing"], st["warned"]) == (3, 3, 0, 0), st
    p = subprocess.run([sys.executable, "-m", "tpprobe", "report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == [
        f"tpprobe watch report over 1 folder(s) ({tmp_path}: ranks [0]): 3 forward(s) checked on one rank, 3 without a "
        f"finding, 0 failing",
        "NOT CHECKED ACROSS RANKS (1 rank: no other rank to compare with, no all-reduce to check): each of the 3 "
        "checked forward(s) ran on a single rank, and its own checks found nothing (no value is NaN or Inf)"], p.stdout
    code, rep = _report(tmp_path)
    assert code == 0 and rep["watch"]["one_rank_groups"] == ["dp0-pp0"], rep["watch"]
