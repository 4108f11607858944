"""Bad input ends in one line that says what is wrong and what to do, exit 2, nothing left behind;
and what a command prints never misleads: no silent change of what was asked, no stale verdict.

Every case is the real CLI: `tpprobe.cli.main` in this process (the console script's own argv
handling and error printing), or `python -m tpprobe` where ranks or a clean interpreter are needed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import ROOT, probe, run_cli
from tpprobe.cli import main


def cli(args: list[str], cap) -> tuple[int, str, str]:
    """main(args) in this process: (exit code, stdout, stderr)."""
    cap.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = cap.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tpprobe: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """One healthy 2-rank capture of the built-in model (the real CLI, gloo)."""
    out = tmp_path_factory.mktemp("bad_input") / "run"
    code, rep, cp = probe(out)
    assert code == 0, cp.stderr[-2000:]
    return out


# ---- tpprobe torchrun: its own options checked before torchrun starts anything --------------------
@pytest.mark.parametrize("args, says", [
    (["--nproc-per-node", "0", "probe"], "--nproc-per-node '0': give the ranks per node, a number >= 1"),
    (["--nproc-per-node", "abc", "probe"], "--nproc-per-node 'abc': give the ranks per node, a number >= 1"),
    (["--nproc-per-node=-2", "probe"], "--nproc-per-node '-2': give the ranks per node, a number >= 1"),
    # probe's own --nproc after the command: never matched against torchrun's option names
    (["probe", "--nproc", "0"], "probe --nproc starts ranks itself; under torchrun the ranks are torchrun's: "
                                "put --nproc-per-node N before probe"),
    (["--nproc-per-node", "2", "probe", "--nproc=4"], "probe --nproc starts ranks itself"),
])
def test_torchrun_options_that_cannot_work_are_one_line_exit_2(capsys, args, says):
    code, out, err = cli(["torchrun", *args], capsys)
    assert code == 2, err
    assert says in one_line(err)
    assert "ambiguous" not in err


# ---- report sinks: a folder given for a file -------------------------------------------------------
@pytest.mark.parametrize("flag", ["--markdown", "--html"])
def test_report_sink_that_is_a_folder_is_refused_and_leaves_no_temporary(capture, tmp_path, monkeypatch, capsys,
                                                                          flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sink").mkdir()
    code, out, err = cli(["report", capture, flag, "sink"], capsys)
    assert code == 2, err
    name = "report.md" if flag == "--markdown" else "report.html"
    assert one_line(err) == f"tpprobe: error: {flag} sink is a folder; give a file name, e.g. {flag} sink/{name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sink"] and not list((tmp_path / "sink").iterdir())


# ---- report sinks: never over a capture folder's own files ---------------------------------------------
@pytest.mark.parametrize("flag, name, what", [
    ("--markdown", "manifest.json", "the manifest of"), ("--html", "rank-001.safetensors", "rank 1's tensors in"),
    ("--markdown", "rank-000.json", "rank 0's metadata in"), ("--html", "report.json", "the report.json of")])
def test_a_sink_over_a_capture_folders_own_file_is_refused(capture, tmp_path, monkeypatch, capsys, flag, name, what):
    d = tmp_path / "run"
    shutil.copytree(capture, d)
    monkeypatch.chdir(tmp_path)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    code, out, err = cli(["report", "run", flag, f"run/{name}"], capsys)
    assert code == 2 and out == "", out + err
    example = "report.md" if flag == "--markdown" else "report.html"
    assert one_line(err) == (f"tpprobe: error: {flag} run/{name} names {what} the capture folder {d}: tpprobe never "
                             f"writes over a capture's own files; give another file name, e.g. {flag} {d / example}")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    # beside them, or an existing file of the same name outside a capture folder: written as always
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / name).write_text("old")
    for target in (d / example, tmp_path / "notes" / name):
        code, out, err = cli(["report", "run", flag, target, "--quiet"], capsys)
        assert code == 0 and err == "" and target.read_text().strip() and target.read_text() != "old", err


def test_a_probe_sink_over_the_files_it_writes_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["probe", "--nproc", "1", "--out", "new", "--markdown", "new/report.json"], capsys)
    assert code == 2 and out == "", err
    assert one_line(err) == (f"tpprobe: error: --markdown new/report.json names the report.json of the capture folder "
                             f"{tmp_path / 'new'}: tpprobe never writes over a capture's own files; give another file "
                             f"name, e.g. --markdown {tmp_path / 'new' / 'report.md'}")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_leaves_no_temporary_beside_its_target(tmp_path):
    from tpprobe.formats.capture_dir import atomic_write_bytes
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "taken", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ---- a damaged capture folder: what is damaged, in one line; never the folder's old verdict ---------
def _damage(d: Path, how: str) -> str:
    if how == "truncated":
        p = d / "rank-001.safetensors"
        p.write_bytes(p.read_bytes()[:1000])
        return "rank-001.safetensors (rank 1): size 1000 bytes, manifest says"
    if how == "missing":
        (d / "rank-001.safetensors").unlink()
        return "rank-001.safetensors (rank 1): missing"
    p = d / "rank-001.json"
    p.write_text("{broken")
    return "rank-001.json (rank 1): size 7 bytes, manifest says"


@pytest.mark.parametrize("how", ["truncated", "missing", "broken-json"])
def test_a_damaged_capture_folder_is_one_line_naming_the_damage_exit_2(capture, tmp_path, capsys, how):
    d = tmp_path / "copy"
    shutil.copytree(capture, d)
    assert json.loads((d / "report.json").read_text())["exit_code"] == 0     # the folder's own, older verdict
    says = _damage(d, how)
    code, out, err = cli(["report", d], capsys)
    assert code == 2, out + err
    line = one_line(err)
    assert line.startswith(f"tpprobe: error: {d}: damaged capture folder, nothing compared: {says}"), line
    assert line.endswith("rank 0 is still readable (--json shows them); re-run the probe or copy the folder again")
    assert out == "" and "HEALTHY" not in err and "report.json" not in err
    code, out, err = cli(["report", d, "--json"], capsys)          # scripts still get every readable rank
    rep = json.loads(out)
    assert code == 2 and rep["exit_code"] == 2
    assert [f["where"] for f in rep["findings"] if f["kind"] == "capture-file"] == [says.split(" ")[0]]


def test_an_offline_report_never_points_at_the_folders_own_report_json(capture, capsys):
    code, out, err = cli(["report", capture], capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "captures and report.json" not in flat
    assert f"captures: {capture} (this report is read from them and not saved)" in flat


# ---- a model too big for this machine: one line, exit 2, its size whole -----------------------------------
def test_a_model_that_cannot_be_allocated_is_one_line_with_its_size_and_the_options_that_shrink_it(tmp_path):
    """The built-in model's embedding at a vocabulary of 4e9 rows needs 1024 GB: torch's allocator refuses it
    on the rank; the probe says so in one line with the size (never cut mid-number) and the built-in model's
    own options, exit 2, nothing written."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("this kernel overcommits every allocation: the refusal would be an OOM kill")
    cp = run_cli(["probe", "--vocab", "4000000000", "--out", str(tmp_path / "r")], timeout=300)
    assert cp.returncode == 2, cp.stderr[-2000:]
    line = one_line(cp.stderr)        # both ranks fail alike; the line names one of them
    assert line.replace("rank 1 ", "rank 0 ") == (
        "tpprobe: error: rank 0 ran out of memory building the model (an allocation of 1024.0 GB failed); shrink it: "
        "--vocab, --hidden, --ffn, --num-layers, --tokens, or fewer --nproc"), line
    assert not (tmp_path / "r").exists()


def test_a_reference_forward_that_cannot_be_allocated_is_one_line_with_the_options_that_shrink_it(tmp_path):
    """At 200000 tokens each rank's forward runs, but the unsharded reference forward rank 0 checks them against
    (all heads in one process) asks torch for a 40 GB attention mask: the same one line as a build that does not
    fit, with the options that shrink the model (not --nproc: the reference is never split), exit 2, and the rank
    files written before it are not left behind."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("this kernel overcommits every allocation: the refusal would be an OOM kill")
    mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    if mem["MemTotal"] + mem.get("SwapTotal", 0) > 40e9:
        pytest.skip("this machine could hold the 40 GB mask")
    cp = run_cli(["probe", "--tokens", "200000", "--exchange", "fingerprint", "--out", str(tmp_path / "r")],
                 timeout=300)
    assert cp.returncode == 2, cp.stderr[-2000:]
    assert one_line(cp.stderr) == (
        "tpprobe: error: rank 0 ran out of memory in the unsharded reference forward, the whole model in one process "
        "that the ranks are checked against (an allocation of 40.0 GB failed); shrink it: --vocab, --hidden, --ffn, "
        "--num-layers, --tokens")
    assert not (tmp_path / "r").exists()


# ---- ids and configs: never silently changed, never the wrong file taken for the right one ----------
@pytest.mark.parametrize("args, says", [
    (["layers", "--ids", "1,,2"], "--ids '1,,2' has an empty entry: give comma-separated integers like -1,2,30"),
    (["layers", "--ids", "1,2,"], "--ids '1,2,' has an empty entry"),
    (["layers", "--ids", ""], "--ids '' is empty: give comma-separated layer ids like -1,2,30, or leave --ids out for "
                              "the default"),
    (["layers", "--ids", " ", "--arch", "all"], "--ids ' ' is empty"),
    (["probe", "--layers", "1,,2"], "--layers '1,,2' has an empty entry: give comma-separated integers like -1,1,3"),
    (["probe", "--layers", ","], "--layers ',' has an empty entry"),
])
def test_an_id_list_with_an_empty_entry_is_refused_not_shortened(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(args, capsys)
    assert code == 2 and says in one_line(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env, inject, says", [
    ({"TPPROBE_INJECT_SCALE": "abc"}, ["--inject", "allreduce-scaled@1"],
     "TPPROBE_INJECT_SCALE='abc': not a finite number (the factor a wrong-sum --inject (allreduce-scaled) multiplies"),
    ({"TPPROBE_STOP_GRACE_S": "soon"}, [], "TPPROBE_STOP_GRACE_S='soon': not a finite number"),
    ({"TPPROBE_STACKS_AFTER": "inf"}, [], "TPPROBE_STACKS_AFTER='inf': not a finite number"),
    ({"TPPROBE_FP_WARPS": "4.9"}, [], "TPPROBE_FP_WARPS='4.9': not an integer"),
    ({"TPPROBE_RANK_START": "bogus"}, [], "TPPROBE_RANK_START='bogus': say auto, fork or spawn"),
])
def test_a_bad_setting_is_one_line_exit_2_and_leaves_no_folder(tmp_path, monkeypatch, capsys, env, inject, says):
    # read before any rank starts (a rank's own ValueError would read as a bug in tpprobe, exit 3)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = cli(["probe", "--quiet", "--out", str(tmp_path / "r"), *inject], capsys)
    assert code == 2 and one_line(err).startswith(f"tpprobe: error: {says}"), err
    assert not (tmp_path / "r").exists()


def test_a_flag_set_empty_or_to_a_word_is_not_read_as_a_number(tmp_path, monkeypatch, capsys):
    # flags (read as set / "0") and an empty number (its default) pass the check that numbers are numbers
    for k, v in {"TPPROBE_FAST_HOOKS": "", "TPPROBE_AUDIT_DOORS": "yes", "TPPROBE_STOP_GRACE_S": ""}.items():
        monkeypatch.setenv(k, v)
    from tpprobe.config.knobs import check_numeric_knobs
    check_numeric_knobs()


def test_a_target_config_given_as_the_draft_config_is_refused(tmp_path, capsys):
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}))
    copy = tmp_path / "also_target.json"
    copy.write_text(target.read_text())
    code, out, err = cli(["layers", "--draft-config", copy, "--target-config", target], capsys)
    assert code == 2 and out == ""
    assert one_line(err).startswith(f"tpprobe: error: --draft-config {copy} is a DeepseekV3ForCausalLM model of 61 "
                                    f"layers, not an EAGLE-3 draft's config")
    code, out, err = cli(["layers", "--draft-config", target, "--target-config", target], capsys)
    assert code == 2 and f"--draft-config {target} is the --target-config itself" in one_line(err)
    # a draft with no ids of its own is still a draft: it expects SGLang's default capture
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                 "draft_vocab_size": 32000}))
    code, out, err = cli(["layers", "--draft-config", draft, "--target-config", target], capsys)
    assert code == 0 and "agree on every slot" in " ".join(out.split()), out + err


@pytest.mark.parametrize("engine", ["sglang", "vllm", "builtin"])
def test_a_draft_config_given_as_the_probes_config_is_refused(tmp_path, capsys, engine):
    # an EAGLE-3 draft's config.json names model_type llama: read as a target's it probed a 1-layer Llama
    draft = ROOT / "examples" / "eagle3" / "draft_config.json"
    code, out, err = cli(["probe", "--engine", engine, "--config", draft, "--out", tmp_path / "r"], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == (
        f"tpprobe: error: --config {draft} is an EAGLE-3 draft's config (LlamaForCausalLMEagle3), not a target "
        f"model's: probe the target's config.json; a draft's config goes to `tpprobe layers --draft-config`, "
        f"`tpprobe fix --draft` and `tpprobe accept --draft`")
    # a draft known by its keys alone (a Llama class, its own aux ids) is one too
    keyed = tmp_path / "draft.json"
    keyed.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    code, out, err = cli(["probe", "--engine", engine, "--config", keyed, "--out", tmp_path / "r"], capsys)
    assert code == 2 and f"--config {keyed} is an EAGLE-3 draft's config (its eagle_config), not a target" in \
        one_line(err)
    assert not (tmp_path / "r").exists()


def test_a_draft_config_given_as_the_target_config_is_refused(tmp_path, capsys):
    # `tpprobe layers` and `tpprobe fix` read --target-config for the target's architecture and depth: a draft's
    # config there would be read as a 1-layer Llama target, as a probe's --config would
    draft = ROOT / "examples" / "eagle3" / "draft_config.json"
    as_target = tmp_path / "config.json"
    as_target.write_text(draft.read_text())
    head = (f"tpprobe: error: --target-config {as_target} is an EAGLE-3 draft's config (LlamaForCausalLMEagle3), not a "
            f"target model's: ")
    code, out, err = cli(["layers", "--draft-config", draft, "--target-config", as_target], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == head + "give the target model's config.json as --target-config and the draft's as " \
                                   "--draft-config"
    code, out, err = cli(["fix", "--draft", tmp_path, "--streams", tmp_path, "--target-config", tmp_path], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == head.replace(str(as_target), str(tmp_path)) + (
        "give the target model's config.json as --target-config (or its --arch); the draft's checkpoint folder goes "
        "to --draft")


def test_an_unreadable_config_is_said_before_any_engine_is_imported(tmp_path):
    bad = tmp_path / "notjson.json"
    bad.write_text("not json")
    code = ("import sys\nfrom tpprobe.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'sglang' in sys.modules, 'vllm' in sys.modules)\n")
    for backend in ("sglang", "vllm"):
        cp = subprocess.run([sys.executable, "-c", code, "probe", "--engine", backend, "--config", str(bad),
                             "--out", str(tmp_path / backend)], capture_output=True, text=True, cwd=ROOT,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert cp.stdout.split() == ["exit", "2", "False", "False"], cp.stdout + cp.stderr
        assert one_line(cp.stderr) == (f"tpprobe: error: --config {bad}: cannot read a JSON config (Expecting value: "
                                       f"line 1 column 1 (char 0)); give a HF config.json")


# ---- the default ids fitted to a shallow model are said ----------------------------------------------
def test_default_ids_cut_by_a_shallow_model_are_said_and_given_ids_are_not(tmp_path):
    cp = run_cli(["probe", "--num-layers", "2", "--out", str(tmp_path / "two"), "--quiet"], timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert cp.stderr.strip().splitlines()[0] == (
        "tpprobe: note: a 2-layer model: the default ids are -1,0 (2 slots), not -1,1,3 (3 slots): fitted to this "
        "depth; give --layers to choose")
    assert json.loads((tmp_path / "two" / "report.json").read_text())["settings"]["layer_ids"] == [-1, 0]
    cp = run_cli(["probe", "--num-layers", "2", "--layers", "-1,0", "--out", str(tmp_path / "given"), "--quiet"],
                 timeout=300)
    assert cp.returncode == 0 and "note" not in cp.stderr, cp.stderr[-2000:]


def test_the_sglang_default_ids_of_a_shallow_model_are_said_before_anything_starts():
    from tpprobe.probe.prepare import default_ids_note, options_from_cli
    opts = options_from_cli(num_layers=2, engine="sglang", nproc=2, inject=[], layers=None)
    assert opts.layers == [-1]
    assert default_ids_note(opts) == ("tpprobe: note: a 2-layer model: the default ids are -1 (1 slot), not -1,1,3 "
                                      "(3 slots): fitted to this depth; give --layers to choose")
    assert default_ids_note(options_from_cli(num_layers=6, engine="sglang", nproc=2, inject=[])) is None


def test_the_vllm_runner_note_is_for_who_serves_vllm(tmp_path, capsys):
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61}))
    draft = tmp_path / "draft.json"       # nested ids only: vLLM's v1 runner reads them, its v2 runner does not
    draft.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    args = ["layers", "--draft-config", draft, "--target-config", target]
    note = "vLLM's v1 model runner reads other ids"
    code, out, err = cli(args, capsys)
    flat = " ".join(out.split())
    assert code == 0 and "the draft and the target agree on every slot" in flat and note not in flat, out + err
    for more in (["--engine", "vllm"], ["--vllm-runner", "v2"]):
        code, out, err = cli(args + more, capsys)
        assert note in " ".join(out.split()), more
    code, out, err = cli(args + ["--json"], capsys)
    assert note in json.loads(out)["engines"]["notes"][0]


# ---- a .pt file that would run code: one clean line, torch's own essay left out --------------------------
class _Runs:
    """Unpickling this would call Path.write_text (a weights-only load never does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "executed"))


def test_a_pickle_that_would_run_code_is_refused_in_one_clean_line(tmp_path, capsys):
    import torch

    from tpprobe.core.errors import CaptureError
    from tpprobe.formats.capture_dir import safe_torch_load
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    torch.save({"aux_hidden_state": torch.ones(2), "x": _Runs(marker)}, evil)
    code, out, err = cli(["diff", evil, evil], capsys)
    assert code == 2 and not marker.exists()
    assert one_line(err) == (f"tpprobe: error: {evil}: refused: loading it would call getattr; "
                             f"tpprobe loads .pt files with torch.load(weights_only=True) only: tensors and plain "
                             f"containers, never code")
    with pytest.raises(CaptureError) as e:
        safe_torch_load(evil)
    assert str(e.value).startswith(f"{evil}: refused to load: loading it would call getattr;")
    assert "PyTorch 2.6" not in str(e.value) and len(str(e.value)) - len(str(evil)) < 160 and not marker.exists()


# ---- the same guess on every model that can show it ------------------------------------------------------
@pytest.mark.parametrize("exchange", ["full", "fingerprint"])
def test_capture_no_residual_is_made_and_named_on_the_built_in_model(tmp_path, exchange):
    code, rep, cp = probe(tmp_path / "r", "--inject", "capture-no-residual", "--exchange", exchange)
    assert code == 1, cp.stderr[-2000:]
    failures = [(f["kind"], f["where"], f["ranks"]) for f in rep["findings"] if f["severity"] == "failure"]
    assert failures == [("capture-no-residual", "aux slot 1", [0, 1])], rep["findings"]
    # named at its first slot; the other slot the same capture reaches is in its detail, not left unsaid
    assert "; and slot 2 (id 3) holds the output of all-reduce #8 (layers.3.mlp.down_proj, layer 3, 2 ranks) " \
        "alone" in rep["findings"][0]["detail"], rep["findings"][0]["detail"]


def test_capture_no_residual_on_vllm_is_pointed_at_its_name_there(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["probe", "--engine", "vllm", "--inject", "capture-no-residual"], capsys)
    assert code == 2 and one_line(err) == ("tpprobe: error: --inject capture-no-residual is named aux-no-residual "
                                           "on vLLM's model: --engine vllm --inject aux-no-residual")
