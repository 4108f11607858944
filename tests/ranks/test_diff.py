"""tpprobe diff on real probe runs of the built-in model (captures built once, in parallel)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TPPROBE = [str(Path(sys.executable).with_name("tpprobe"))] if Path(sys.executable).with_name("tpprobe").exists() \
    else [sys.executable, "-m", "tpprobe"]
BASE = ["--layers", "-1,2,5", "--num-layers", "8", "--quiet"]
RUNS = {
    "base": ["--nproc", "2"],
    "tp1": ["--nproc", "1"],
    "bf16": ["--nproc", "1", "--dtype", "bfloat16"],
    "perm": ["--nproc", "2", "--inject", "slot-order"],
    "offset": ["--nproc", "1", "--inject", "capture-offset"],
    "drop": ["--nproc", "1", "--inject", "drop-embed-slot"],
    "skip": ["--nproc", "2", "--inject", "skip-allreduce@2"],
}


@pytest.fixture(scope="session")
def caps(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffcaps")
    procs = {n: subprocess.Popen(TPPROBE + ["probe", *BASE, *a, "--out", str(root / n)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n, a in RUNS.items()}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert (root / n / "manifest.json").exists(), f"probe {n} failed ({p.returncode}): {err.decode()[-800:]}"
    return {n: root / n for n in RUNS}


def tp(*args):
    """`tpprobe diff ...` in this process (a fresh interpreter per call costs seconds of torch import);
    the CLI's own main(), so exit codes and error lines are the real ones."""
    from tpprobe.cli import main
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["diff", *map(str, args)])
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(["tpprobe", "diff", *args], code, out.getvalue(), err.getvalue())


def tp_sub(*args):
    return subprocess.run(TPPROBE + ["diff", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def jdiff(*args):
    r = tp(*args, "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)["results"][0]


def test_identical_exit0(caps):
    rc, res = jdiff(caps["base"], caps["base"])
    assert rc == 0 and res["ok"] and res["kinds"] == ["match"]
    assert res["alignment"]["mode"] == "exact"
    assert [r["target_holds"] for r in res["rows"]] == ["embed.out", "layer.2.out", "layer.5.out"]
    assert all(r["level"] == "bitwise" and r["rel_diff"] == 0 for r in res["rows"])


def test_table_renders(caps):
    r = tp(caps["base"], caps["perm"])
    assert r.returncode == 1
    assert "target slot 0 = baseline slot 1 (layer 2's output)" in r.stdout
    assert "NO MATCH" not in r.stdout and "= b1" in r.stdout


def test_permuted(caps):
    rc, res = jdiff(caps["base"], caps["perm"])
    assert rc == 1 and "permuted" in res["kinds"]
    assert res["match"] == [1, 0, 2]
    assert "target slot 1 = baseline slot 0 (the embedding)" in res["verdict"]


def test_off_by_one(caps):
    rc, res = jdiff(caps["base"], caps["offset"])
    assert rc == 1 and "off-by-one" in res["kinds"]
    assert "layer 1's output was captured where layer 2's output (baseline slot 1) was expected, one layer early" \
        in res["verdict"]
    assert res["cause"]["kind"] == "capture-offset"
    # the target's slots are named by position: the baseline's ids are not the target's
    assert res["cause"]["detail"].startswith("slot 1 equals layer 1's output, expected layer 2's output")


def test_the_right_slot_with_other_values_is_named_as_such(caps):
    # a reduce skipped in layer 2: slots 1 and 2 hold layers 2 and 5 as the baseline's do, computed differently
    rc, res = jdiff(caps["base"], caps["skip"], "--rank", "1")
    assert rc == 1 and res["kinds"] == ["values-differ"] and res["match"] == [0, None, None]
    for j, layer in ((1, 2), (2, 5)):
        assert f"target slot {j} holds layer {layer}'s output, as baseline slot {j} does, with other values (rel " \
            "diff² " in res["verdict"]
    assert "was captured where" not in res["verdict"] and res["cause"] is None


def test_missing_embedding_slot(caps):
    rc, res = jdiff(caps["base"], caps["drop"])
    assert rc == 1 and "missing-slot" in res["kinds"] and "shifted" in res["kinds"]
    assert res["match"][:2] == [1, 2] and res["match"][2] is None
    assert "target slot 2 has no match" in res["verdict"]
    assert "was captured where the embedding (baseline slot 0) was expected" in res["verdict"]


def test_tp1_vs_tp2_within_noise(caps):
    rc, res = jdiff(caps["base"], caps["tp1"])
    assert rc == 0
    assert all(r["level"] in ("bitwise", "noise") and r["rel_diff"] < 1e-9 for r in res["rows"])
    rc, res = jdiff(caps["tp1"], caps["base"], "--all-ranks")
    assert rc == 0


def test_all_ranks(caps):
    r = tp(caps["base"], caps["perm"], "--all-ranks", "--json")
    assert r.returncode == 1
    res = json.loads(r.stdout)["results"]
    assert [x["target"]["rank"] for x in res] == [0, 1] and all(x["match"] == [1, 0, 2] for x in res)


def test_bf16_vs_fp32(caps):
    rc, res = jdiff(caps["base"], caps["bf16"])
    assert rc == 0, res["verdict"]
    for r in res["rows"]:
        assert r["rounded_to"] == "bfloat16" and "as_stored" in r
    # the embedding is a lookup: rounded to bf16 it is bitwise equal, as stored it is not
    assert res["rows"][0]["rel_diff"] == 0 and res["rows"][0]["as_stored"]["rel_diff"] > 0
    # a tight threshold on the deepest slot fails only that slot
    rc, res = jdiff(caps["base"], caps["bf16"], "--threshold", "2=1e-9")
    assert rc == 1 and res["match"][:2] == [0, 1] and res["match"][2] is None


def test_thresholds_parse(caps):
    r = tp(caps["base"], caps["base"], "--threshold", "7=1e-3")
    assert r.returncode == 2 and "slot 7 does not exist" in r.stderr
    r = tp(caps["base"], caps["base"], "--threshold", "abc")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_prefix_and_offset(caps, tmp_path):
    from tpprobe.formats.specforge import read_sample, write_sample
    from tpprobe.formats.capture_dir import load_run
    t = load_run(caps["base"]).records[0].tensors
    write_sample(tmp_path / "pre.ckpt", t["input_ids"][:10], t["aux.packed"][:10])
    rc, res = jdiff(caps["base"], tmp_path / "pre.ckpt")
    assert rc == 0 and res["alignment"]["mode"] == "prefix" and res["alignment"]["tokens"] == 10
    # a serving capture that starts 4 tokens in (prefix-cached): refused unless the offset is stated
    write_sample(tmp_path / "tail.ckpt", t["input_ids"][4:], t["aux.packed"][4:])
    r = tp(caps["base"], tmp_path / "tail.ckpt")
    assert r.returncode == 2 and "token sequences differ" in r.stderr and "--offset 4" in r.stderr
    rc, res = jdiff(caps["base"], tmp_path / "tail.ckpt", "--offset", "4")
    assert rc == 0 and res["alignment"]["mode"] == "offset"
    assert read_sample(tmp_path / "tail.ckpt")["input_ids"].shape == (12,)


def test_different_sequences_refused(caps, tmp_path):
    from tpprobe.formats.specforge import write_sample
    from tpprobe.formats.capture_dir import load_run
    t = load_run(caps["base"]).records[0].tensors
    ids = t["input_ids"].clone()
    ids[6] = (ids[6] + 1) % 131
    write_sample(tmp_path / "other.ckpt", ids, t["aux.packed"])
    r = tp(caps["base"], tmp_path / "other.ckpt")
    assert r.returncode == 2
    assert "baseline token 6" in r.stderr and "refusing" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_specforge_sample_from_capture(caps, tmp_path):
    out = tmp_path / "rows_0-5000" / "data_0.ckpt"
    r = subprocess.run([sys.executable, "-m", "tpprobe", "specforge", str(caps["drop"]), str(out)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out}: a SpecForge EAGLE-3 sample from rank 0")
    d = torch.load(out, weights_only=True)
    assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert d["aux_hidden_state"].shape == (1, 16, 3 * 64) and d["hidden_state"].shape == (1, 16, 64)
    assert d["input_ids"].shape == (16,) and d["loss_mask"].shape == (16,)
    # the sample against its own capture: identical
    rc, res = jdiff(out, caps["drop"])
    assert rc == 0 and res["baseline"]["kind"] == "specforge"
    # the seed's case: training dump (embedding first) vs a serving capture without the embedding
    from tpprobe.formats.specforge import sample_from_capture
    sample = sample_from_capture(caps["base"], tmp_path / "train.ckpt")
    rc, res = jdiff(sample, caps["drop"])
    assert rc == 1
    assert res["identity"]["streams_from"]["baseline"] == "target"    # the dump's slots named by the capture
    assert res["rows"][2]["baseline_holds"] == "embed.out"
    assert "target slot 0 = baseline slot 1 (layer 2's output)" in res["verdict"]
    assert "was captured where the embedding (baseline slot 0) was expected" in res["verdict"]


def test_bare_files(caps, tmp_path):
    from safetensors.torch import save_file
    from tpprobe.formats.capture_dir import load_run
    t = load_run(caps["base"]).records[0].tensors
    save_file({"packed": t["aux.packed"].contiguous()}, str(tmp_path / "p.safetensors"))
    torch.save(t["aux.packed"].clone(), tmp_path / "p.pt")
    r = tp(tmp_path / "p.safetensors", tmp_path / "p.pt")
    assert r.returncode == 2 and "--slots K or --hidden H" in r.stderr
    rc, res = jdiff(tmp_path / "p.safetensors", tmp_path / "p.pt", "--slots", "3")
    assert rc == 0 and res["alignment"]["mode"] == "position"
    rc, res = jdiff(caps["base"], tmp_path / "p.pt")        # hidden taken from the capture
    assert rc == 0
    r = tp(tmp_path / "p.pt", tmp_path / "p.pt", "--slots", "5")
    assert r.returncode == 2 and "not divisible by --slots 5" in r.stderr


def test_rank_file_without_the_embedding_keeps_every_layer_stream(caps, tmp_path):
    """A rank file with no embed.out (embedding not found, or refused by the plugin's budget): every
    layer's stream still names the slots (layer 0's output was once dropped with the embedding)."""
    from safetensors.torch import save_file
    from tpprobe.formats.capture_dir import load_run
    t = {k: v.contiguous() for k, v in load_run(caps["base"]).records[0].tensors.items() if k != "embed.out"}
    save_file(t, str(tmp_path / "noembed.safetensors"))
    rc, res = jdiff(caps["base"], tmp_path / "noembed.safetensors")
    assert rc == 0 and res["target"]["streams"] == 9        # layer.0..7.out and layer 0's input norm
    assert "streams: 8 layer outputs, layer 0's input norm)" in res["target_text"]


@pytest.mark.parametrize("content,expect", [
    (b"this is not a tensor file at all", "unknown file type"),
    (b"PK\x03\x04garbage-zip", "not a readable torch.save file"),
])
def test_malformed_file_exit2(caps, tmp_path, content, expect):
    f = tmp_path / ("junk.txt" if b"PK" not in content else "junk.pt")
    f.write_bytes(content)
    r = tp_sub(caps["base"], f)
    assert r.returncode == 2 and expect in r.stderr and str(f) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_wrong_dict_and_missing_rank(caps, tmp_path):
    torch.save({"a": torch.zeros(2), "b": torch.zeros(3)}, tmp_path / "d.pt")
    r = tp(caps["base"], tmp_path / "d.pt")
    assert r.returncode == 2 and "dict with keys ['a', 'b']" in r.stderr and "SpecForge" in r.stderr
    torch.save({"input_ids": torch.arange(4), "hidden_state": torch.zeros(1, 4, 8)}, tmp_path / "noaux.ckpt")
    r = tp(caps["base"], tmp_path / "noaux.ckpt")
    assert r.returncode == 2 and "no 'aux_hidden_state'" in r.stderr
    r = tp(caps["base"], caps["tp1"], "--rank", "1")
    assert r.returncode == 2 and "rank 1 is not in this capture" in r.stderr
    r = tp(caps["base"], tmp_path / "nothing-here")
    assert r.returncode == 2 and "no such file or folder" in r.stderr


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_executing_pickle_refused(caps, tmp_path):
    marker = tmp_path / "PWNED"
    torch.save({"input_ids": torch.arange(16), "aux_hidden_state": _Evil(marker)}, tmp_path / "evil.ckpt")
    (tmp_path / "evil_legacy.pt").write_bytes(pickle.dumps(_Evil(marker)))
    for f, run in (("evil.ckpt", tp_sub), ("evil_legacy.pt", tp)):
        r = run(caps["base"], tmp_path / f)
        assert r.returncode == 2, r.stderr
        assert "refused" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not marker.exists()


# ---- vLLM's extract_hidden_states file (vLLM PR #33736) as one side ------------------------------------------
def _vllm_file(caps, path, points):
    """A file as vLLM's ExampleHiddenStatesConnector writes it (safetensors: hidden_states [T, K, H] stacked
    in slot order, token_ids [T]), its slots taken from the base capture's residual streams; the vLLM tier
    (tests/engines/vllm/test_vllm_layers.py) writes it with vLLM's own writer."""
    from safetensors.torch import save_file

    from tpprobe.eagle3.diff import load_side
    from tpprobe.formats.vllm_hidden import to_tensors

    s = load_side("baseline", caps["base"])
    save_file(to_tensors([s.streams[p] for p in points], s.input_ids), str(path))
    return path


def test_vllm_extract_hidden_states_as_either_side(caps, tmp_path):
    # vLLM with ids 0, 3, 6 (as written: HF hidden_states[k]) holds what tpprobe's -1, 2, 5 capture holds
    f = _vllm_file(caps, tmp_path / "req-0.safetensors", ["embed.out", "layer.2.out", "layer.5.out"])
    for b, t in ((caps["base"], f), (f, caps["base"])):
        rc, res = jdiff(b, t)
        assert rc == 0 and res["ok"] and res["kinds"] == ["match"], res["verdict"]
        assert {res["baseline"]["kind"], res["target"]["kind"]} == {"capture", "vllm-extract"}
        assert res["alignment"]["mode"] == "exact" and all(r["level"] == "bitwise" for r in res["rows"])
        side = "target" if t == f else "baseline"
        assert [r[f"{side}_holds"] for r in res["rows"]] == ["embed.out", "layer.2.out", "layer.5.out"]


def test_vllm_extract_hidden_states_off_by_one(caps, tmp_path):
    # the draft's output-of-layer ids 0, 2, 5 used as written by vLLM: slot 1 = HF hidden_states[2], layer 1's
    # output, where layer 2's was expected (F26 seen in the served features); slots 0 and 2 as the baseline
    f = _vllm_file(caps, tmp_path / "req-1.safetensors", ["embed.out", "layer.1.out", "layer.5.out"])
    rc, res = jdiff(caps["base"], f)
    assert rc == 1 and res["kinds"] == ["off-by-one"] and res["match"] == [0, None, 2], res["verdict"]
    assert res["verdict"] == ("MISMATCH: target slot 1 has no match: layer 1's output was captured where layer 2's "
                              "output (baseline slot 1) was expected, one layer early (off by one)")
    r = tp(caps["base"], f)
    assert r.returncode == 1 and "vllm extract" in r.stdout


def test_vllm_extract_hidden_states_malformed(caps, tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"hidden_states": torch.zeros(4, 8), "token_ids": torch.zeros(4, dtype=torch.long)},
              str(tmp_path / "flat.safetensors"))
    save_file({"hidden_states": torch.zeros(4, 2, 8), "token_ids": torch.zeros(3, dtype=torch.long)},
              str(tmp_path / "short.safetensors"))
    for name, want in (("flat", "hidden_states is float32 [4, 8], expected vLLM's extract_hidden_states file"),
                       ("short", "4 tokens of hidden_states but 3 token_ids")):
        r = tp(caps["base"], tmp_path / f"{name}.safetensors")
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
