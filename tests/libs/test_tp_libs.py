"""The TP libraries users bring, probed with zero configuration on real gloo ranks: PyTorch's own
DTensor TP (`parallelize_module`, ColwiseParallel / RowwiseParallel: examples/dtensor_llama.py),
Hugging Face transformers' TP (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`
and `tp_plan="auto"`: examples/hf_tp.py) and megatron-core's own GPTModel with the local spec
(examples/megatron_gpt.py). Start with `test_each_library_is_healthy_at_tp2_in_fp32_and_bf16`.

Every healthy run must come out with zero findings and complete coverage: the embedding found by
structure (the module the library builds), 4 of 4 layers hooked and run, a reduce audited in every
layer on every rank, every reduce attributed (to the embedding, or to the row-parallel module that
issued it in its layer) and complete. Every fault is made the library's own way and must be named
exactly (kind, place, ranks): a plan or flag that says "the caller reduces" and nobody does, a wrong
placement (which each library refuses itself: named at the module that raised, once for all ranks),
sequence parallelism's reduce-scatter skipped, a stale replicated parameter on one rank; a DTensor
capture point placed Partial is one root cause at its module, with what follows as its consequences.

Sequence parallelism: Megatron's (`sequence_parallel=True`), torch's own (torchtitan's plan:
`SequenceParallel()` norms whose weights are Replicate DTensors, `RowwiseParallel(output_layouts=Shard(1))`)
and transformers' one SP style (`sequence_parallel` on the norms; 5.19 has no SP plan beyond it).

CI time: one set of gloo ranks per tp size runs all its cases (`tpprobe.probe.pipeline.run` exactly as a rank
of `tpprobe probe` runs it, on a process group kept between cases); CI runs every fault at tp 2 in
fp32 and tp 4 healthy cases, and docs/tp-libraries.md's `tpprobe probe --model examples.X:build --nproc 2` once per
library through the command line (its own launcher and ranks); the rest of the matrix (every fault in
bf16 and at tp 4, every library healthy at tp 4 in both dtypes) is `-m sweep`.
Needs the tier: `bash ci/tp-libs/install.sh .venv` (marker `tplibs`).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers.ranks import spawn

pytestmark = pytest.mark.tplibs

# library -> (example module, embedding module, layer list, row-parallel module names in a layer)
LIBS = {
    "dtensor": ("examples.dtensor_llama", "tok_embeddings", "layers", ("attention.wo", "feed_forward.w2")),
    "hf": ("examples.hf_tp", "model.embed_tokens", "model.layers", ("self_attn.o_proj", "mlp.down_proj")),
    "megatron": ("examples.megatron_gpt", "embedding", "decoder.layers",
                 ("self_attention.linear_proj", "mlp.linear_fc2")),
}
NEEDS = {"dtensor": None, "hf": "transformers", "megatron": "megatron.core"}
ALL = "all"          # the ranks of a fault every rank has: all of them, at any tp
# fault case -> (factory, the one failure: kind, where, ranks). Each made the library's own way:
# (a) a plan or flag that says "the caller reduces" and nobody does; (b) a wrong placement, two per
# library (the MLP's row-parallel projection, and a column-parallel projection in attention): each
# library refuses it itself, with a shape error, and tpprobe names the module the forward raised in;
# (c) sequence parallelism's reduce-scatter skipped;
# (d) a stale replicated parameter on one rank, named as that parameter on that rank.
FAULTS = {
    "dtensor-partial": ("examples.dtensor_llama:build_partial",                                  # (a)
                        ("partial-allreduce", "layer 2 (layers.2.feed_forward.w2)", ALL)),
    "dtensor-colwise": ("examples.dtensor_llama:build_colwise_w2",                               # (b)
                        ("rank-error", "layer 2 (layers.2.feed_forward.w2)", ALL)),
    "dtensor-rowwise_wq": ("examples.dtensor_llama:build_rowwise_wq",                            # (b) attention
                           ("rank-error", "layer 2 (layers.2.attention.wq)", ALL)),
    "dtensor-stale": ("examples.dtensor_llama:build_stale_norm",                                 # (d)
                      ("rank-divergence", "layer 2 parameter layers.2.ffn_norm.weight", [1])),
    # torchtitan's sequence parallelism: the norms are SequenceParallel, their weights Replicate DTensors
    # (each rank normalises its own chunk, so a stale one leaves the gathered stream alike on every rank:
    # only the parameter's local tensor, hashed, shows it); the reduce-scatter skipped the library's way
    "dtensor-sp_stale": ("examples.dtensor_llama:build_sequence_parallel_stale_norm",            # (d)
                         ("rank-divergence", "layer 2 parameter layers.2.ffn_norm.weight", [1])),
    "dtensor-sp_scatter": ("examples.dtensor_llama:build_sequence_parallel_scatter",             # (c)
                           ("partial-allreduce", "layer 2 (layers.2.feed_forward.w2)", ALL)),
    "hf-local_rowwise": ("examples.hf_tp:build_local_rowwise",                                   # (a)
                         ("partial-allreduce", "layer 0 (model.layers.0.mlp.down_proj)", ALL)),
    "hf-swapped_plan": ("examples.hf_tp:build_swapped_plan",                                     # (b)
                        ("rank-error", "layer 0 (model.layers.0.mlp.down_proj)", ALL)),
    "hf-swapped_q_proj": ("examples.hf_tp:build_swapped_q_proj",                                 # (b) attention
                          ("rank-error", "layer 0 (model.layers.0.self_attn.q_proj)", ALL)),
    "hf-stale": ("examples.hf_tp:build_stale_norm",                                              # (d)
                 ("rank-divergence", "layer 2 parameter model.layers.2.post_attention_layernorm.weight", [1])),
    # transformers' own `sequence_parallel` style on the norms: the stale weight is a Replicate DTensor
    "hf-sp_norms_stale": ("examples.hf_tp:build_sequence_parallel_norms_stale",                  # (d)
                          ("rank-divergence", "layer 2 parameter model.layers.2.post_attention_layernorm.weight",
                           [1])),
    "megatron-explicit_comm": ("examples.megatron_gpt:build_explicit_comm",                      # (a)
                               ("partial-allreduce", "layer 2 (decoder.layers.2.mlp.linear_fc2)", ALL)),
    "megatron-input_not_parallel": ("examples.megatron_gpt:build_input_not_parallel",            # (b)
                                    ("rank-error", "layer 2 (decoder.layers.2.mlp.linear_fc2)", ALL)),
    # the column-parallel qkv gathered whole: refused where the attention splits it per head (its
    # forward, not linear_qkv's: tpprobe names the module the forward raised in)
    "megatron-gather_qkv": ("examples.megatron_gpt:build_gather_qkv",                            # (b) attention
                            ("rank-error", "layer 2 (decoder.layers.2.self_attention)", ALL)),
    "megatron-stale": ("examples.megatron_gpt:build_stale_norm",                                 # (d)
                       ("rank-divergence", "layer 2 parameter decoder.layers.2.pre_mlp_layernorm.weight", [1])),
    "megatron-stale_bias": ("examples.megatron_gpt:build_stale_bias",                              # (d)
                            ("rank-divergence", "layer 2 parameter decoder.layers.2.mlp.linear_fc2.bias", [1])),
    "megatron-sp_scatter": ("examples.megatron_gpt:build_sequence_parallel_scatter",             # (c)
                            ("partial-allreduce", "layer 2 (decoder.layers.2.mlp.linear_fc2)", ALL)),
}


def build_with_meta_param(ctx):
    """The DTensor Llama with one parameter left on the meta device (a load that never filled it):
    its bytes cannot be read, so its hash cannot be taken."""
    import torch
    from examples.dtensor_llama import build

    target = build(ctx)
    norm = target.model.layers["1"].ffn_norm
    norm.register_parameter("unloaded", torch.nn.Parameter(torch.empty(3, device="meta"), requires_grad=False))
    return target


def _need(*libs):
    for lib in libs:
        if NEEDS[lib]:
            pytest.importorskip(NEEDS[lib], reason="the tp-libs tier: bash ci/tp-libs/install.sh .venv")


def _run_cases(rank, world, cases, root):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from tpprobe.probe.pipeline import ProbeOptions, run
    out = {}
    for i, (name, model, env) in enumerate(cases):
        os.environ["TORCHELASTIC_RUN_ID"] = f"tplibs-{world}-{i}"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        t0 = time.time()
        try:
            code = run(ProbeOptions(model=model, layers=[-1, 0, 1], out=os.path.join(root, name), quiet=True,
                                    timeout=120), keep_group=True)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if rank == 0:
            with open(os.path.join(root, name, "report.json")) as f:
                rep = json.load(f)
            out[name] = {"code": code, "findings": rep["findings"], "coverage": rep.get("coverage", {}),
                         "allreduce": rep["allreduce"], "seconds": round(time.time() - t0, 1)}
        if _raises(name):
            _fresh_group(rank, world, root, i)
    return out


def _raises(name: str) -> bool:
    """A case whose forward raises on every rank (a wrong placement the library refuses)."""
    f = FAULTS.get(name) or FAULTS.get(name.rsplit("-", 1)[0])
    return f is not None and f[1][0] == "rank-error"


def _fresh_group(rank, world, root, i):
    """A new gloo group (and Megatron's groups over it) after a case whose forward raised: at tp 4 the
    next case's first collective on the kept group was refused ("Connection reset by peer"), which a
    real `tpprobe probe` (one process per run) never meets; each case must be judged on its own."""
    import sys

    import torch.distributed as dist
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    from tpprobe.exchange import gather
    dist.destroy_process_group()
    gather.reset()        # the probe's own gloo group lived on the old one: made again on first use
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, f'rdzv-after-{i}')}", rank=rank,
                            world_size=world)


def _probe_all(tmp_path, world, cases, timeout=600):
    res = spawn(_run_cases, world, cases, str(tmp_path), timeout=timeout)[0]
    print({k: v["seconds"] for k, v in res.items()})          # each case's wall time (pytest -s)
    return res


def _failures(res):
    return [(f["kind"], f["where"], f["ranks"]) for f in res["findings"] if f["severity"] == "failure"]


def assert_healthy(name, res, world, lib):
    _, embed, layer_list, rows = LIBS[lib]
    cov = res["coverage"]
    assert res["code"] == 0 and res["findings"] == [], (name, res["findings"])
    assert cov["embed"] == embed and cov["embed_how"] == "structure", (name, cov)
    assert cov["layer_list"] == layer_list and cov["layer_how"] == "structure", (name, cov)
    assert cov["layers_found"] == cov["layers_ran"] == 4, (name, cov)
    assert cov["unreadable_paths"] == {}, (name, cov)
    places = cov["reduces_per_place"]
    assert all(places.get(f"layer.{k}", {}).get(str(r), 0) == len(rows) for k in range(4) for r in range(world)), \
        (name, places)
    ar = res["allreduce"]
    assert ar["checked"] > 0 and ar["incomplete"] == 0, (name, ar)
    reduces = [a for a in ar["records"] if a["kind"] in ("all_reduce", "reduce_scatter")]
    assert reduces and all(a["group_size"] == world for a in reduces), (name, reduces)
    for a in reduces:               # every reduce attributed: the embedding's, or its layer's row-parallel module
        if a["where"] == "embed":
            assert a["module"].startswith(embed), (name, a)
        else:
            k = int(a["where"].split(".")[1])
            assert a["source"] in {f"{layer_list}.{k}.{r}" for r in rows}, (name, a)


def _healthy_cases(libs, dtypes):
    return [(f"{lib}-{d}", f"{LIBS[lib][0]}:build", {"TPLIBS_DTYPE": d}) for lib in libs for d in dtypes]


def test_each_library_is_healthy_at_tp2_in_fp32_and_bf16_and_each_fault_is_named_exactly(tmp_path):
    import torch
    _need("dtensor", "hf", "megatron")
    cases = _healthy_cases(LIBS, ("float32", "bfloat16"))
    cases.append(("hf-tp_plan_auto", "examples.hf_tp:build_tp_plan_auto", {"TPLIBS_DTYPE": "bfloat16"}))
    cases.append(("megatron-sp-bfloat16", "examples.megatron_gpt:build_sequence_parallel",
                  {"TPLIBS_DTYPE": "bfloat16"}))
    cases += [(f"dtensor-sp-{d}", "examples.dtensor_llama:build_sequence_parallel", {"TPLIBS_DTYPE": d})
              for d in ("float32", "bfloat16")]
    cases.append(("hf-sp_norms-bfloat16", "examples.hf_tp:build_sequence_parallel_norms", {"TPLIBS_DTYPE": "bfloat16"}))
    cases += [(name, factory, {}) for name, (factory, _) in FAULTS.items()]
    cases.append(("dtensor-meta_param", "tests.libs.test_tp_libs:build_with_meta_param", {}))
    cases.append(("dtensor-partial_stream", "tests.libs.test_tp_libs:build_partial_stream", {}))
    res = _probe_all(tmp_path, 2, cases)
    for name, *_ in cases:
        if name in FAULTS or name in ("dtensor-meta_param", "dtensor-partial_stream"):
            continue
        assert_healthy(name, res[name], 2, name.split("-")[0])
    for name in FAULTS:
        assert_fault(name, res[name], 2)
    # a parameter tpprobe cannot read is named in a coverage warning; the rank's record is kept
    meta = res["dtensor-meta_param"]
    assert meta["code"] == 0 and _failures(meta) == [], meta["findings"]
    (warn,) = [f for f in meta["findings"] if f["severity"] == "warning"]
    assert (warn["kind"], warn["where"], warn["ranks"]) == ("coverage", "unreadable tensors", [0, 1]), warn
    assert "parameter layers.1.ffn_norm.unloaded on ranks 0, 1 (Parameter: NotImplementedError" in warn["detail"], warn
    # a layer output that is a DTensor placed Partial owes a reduce: named from its placement, and the
    # row-parallel module whose reduce never ran in that layer is named too (read locally: no redistribute)
    # it is one root cause at its place (module, layer, ranks): the stream's missing reduce in that layer
    # and the divergence of every later point are its consequences, never findings of their own
    ps = res["dtensor-partial_stream"]
    assert ps["code"] == 1 and _failures(ps) == [("partial-allreduce", "layer 2 (blocks.2.down)", [0, 1])], \
        ps["findings"]
    (root,) = ps["findings"]
    assert "layer 2's output is a DTensor placed Partial(sum) on ranks 0, 1 (the output of blocks.2.down, " \
           "placed Partial)" in root["detail"], root
    assert root["evidence"]["placements"] == ["Partial(sum)"] and root["evidence"]["point"] == "layer.2.out", root
    assert root["consequences"][0].startswith("layer 2 (blocks.2.down): blocks.2.down output was never "
                                              "all-reduced"), root["consequences"]
    assert any(c.startswith("layer.2.out: ranks ") for c in root["consequences"]), root["consequences"]
    # transformers' local_rowwise is in every layer's plan: named at the first layer, said for all
    detail = next(f["detail"] for f in res["hf-local_rowwise"]["findings"] if f["severity"] == "failure")
    assert "unreduced in every layer (4 of 4)" in detail, detail
    # Megatron's sequence parallelism: the reduces are reduce-scatters, the stream a chunk per rank
    sp = res["megatron-sp-bfloat16"]
    assert {a["kind"] for a in sp["allreduce"]["records"]} == {"reduce_scatter", "all_gather"}, sp["allreduce"]
    assert_dtensor_sequence_parallel(res, 2)
    # the sequence-parallel stream tpprobe gathers from each rank's [b, s / tp, h] chunk is the plain TP
    # stream, token for token (the same weights): a misordered gather would look alike on every rank,
    # so only this comparison shows one
    from tpprobe.formats.capture_dir import load_run
    plain, sp = (load_run(tmp_path / n).records[0].tensors for n in ("dtensor-float32", "dtensor-sp-float32"))
    for point in ("embed.out", "layer.0.out", "layer.3.out"):
        assert sp[point].shape == plain[point].shape == (8, 32), point
        assert torch.allclose(sp[point], plain[point], rtol=1e-4, atol=1e-5), \
            (point, (sp[point] - plain[point]).abs().max())
    # each rank's own share of the embedding (the reduce-scatter's input) in token rows too: the ranks' shares
    # sum to the embedding's output
    shares = [load_run(tmp_path / "dtensor-sp-float32").records[r].tensors["embed.local"] for r in (0, 1)]
    assert shares[0].shape == (8, 32) and torch.allclose(shares[0] + shares[1], sp["embed.out"], atol=1e-6), \
        [tuple(t.shape) for t in shares]


def assert_dtensor_sequence_parallel(res, world):
    """torch's own sequence parallelism (torchtitan's plan): every reduce is a reduce-scatter to Shard(1)
    (the stream a [b, s / tp, h] chunk per rank, gathered by tpprobe after the forward); its faults (when
    run) are named from what they are: the stale norm weight as the Replicate DTensor it is, read through
    its local tensor, and the skipped reduce-scatter as the one w2 owed."""
    for name in [n for n in res if n.startswith("dtensor-sp-")]:
        reduces = {a["kind"] for a in res[name]["allreduce"]["records"] if a["kind"] != "all_gather"}
        assert reduces == {"reduce_scatter"}, (name, world, res[name]["allreduce"])
    for name, param in (("dtensor-sp_stale", "layers.2.ffn_norm.weight"),
                        ("hf-sp_norms_stale", "model.layers.2.post_attention_layernorm.weight")):
        if name in res:
            (stale,) = [f for f in res[name]["findings"] if f["severity"] == "failure"]
            assert stale["evidence"]["placements"] == ["Replicate()"], stale
            assert f"{param} (a DTensor placed Replicate(): its local tensor) differs on rank 1" in stale["detail"], \
                stale
    if "dtensor-sp_scatter" in res:
        (scatter,) = [f for f in res["dtensor-sp_scatter"]["findings"] if f["severity"] == "failure"]
        assert "the reduce-scatter (_c10d_functional.reduce_scatter_tensor) issued by layers.2.feed_forward.w2 " \
               "never ran" in scatter["detail"], scatter


def assert_fault(name, res, world):
    kind, where, ranks = FAULTS[name][1]
    ranks = list(range(world)) if ranks == ALL else ranks
    assert res["code"] == 1 and _failures(res) == [(kind, where, ranks)], (name, world, res["findings"])
    if kind == "rank-error":        # the library's own refusal, said once for every rank that raised it
        (f,) = [f for f in res["findings"] if f["severity"] == "failure"]
        assert f["detail"].startswith("RuntimeError: ") and ("shape" in f["detail"] or " dim" in f["detail"]), \
            (name, f)


@pytest.mark.sweep       # tp 2 runs in CI: each library healthy in both dtypes and each fault named
def test_each_library_is_healthy_at_tp4(tmp_path):
    _need("dtensor", "hf", "megatron")
    cases = [("dtensor-bfloat16", "examples.dtensor_llama:build", {"TPLIBS_DTYPE": "bfloat16"}),
             ("hf-float32", "examples.hf_tp:build", {"TPLIBS_DTYPE": "float32"}),
             ("megatron-bfloat16", "examples.megatron_gpt:build", {"TPLIBS_DTYPE": "bfloat16"}),
             ("megatron-sp-float32", "examples.megatron_gpt:build_sequence_parallel", {"TPLIBS_DTYPE": "float32"}),
             ("dtensor-sp-bfloat16", "examples.dtensor_llama:build_sequence_parallel", {"TPLIBS_DTYPE": "bfloat16"})]
    res = _probe_all(tmp_path, 4, cases)
    for name, *_ in cases:
        assert_healthy(name, res[name], 4, name.split("-")[0])
    assert_dtensor_sequence_parallel(res, 4)


# docs/tp-libraries.md's tp-2 example commands (scripts/readme_commands.py leaves them to the test below)
CLI = r"^PYTHONPATH=\. tpprobe probe --model examples\.(dtensor_llama|hf_tp|megatron_gpt):build --nproc 2$"


@pytest.mark.parametrize("lib", list(LIBS))
def test_the_command_line_probes_each_library_healthy_at_tp2(tmp_path, lib):
    """The path the issue's crash was on: the documented `tpprobe probe --model examples.X:build
    --nproc 2`, run as written (a fresh bash with only the venv activated, in a folder holding the
    checkout, as tests/house/test_readme.py runs README commands): tpprobe's launcher starts the ranks, each
    imports the user's factory by name and builds the library's model. Exit 0, HEALTHY, and its
    report.json is healthy with complete coverage (assert_healthy)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import importlib.util
    if NEEDS[lib] and importlib.util.find_spec(NEEDS[lib].split(".")[0]) is None:   # not imported here: the
        pytest.skip("the tp-libs tier: bash ci/tp-libs/install.sh .venv")           # ranks do (megatron: 12 s)
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import readme_commands as rc
    cmds = {re.match(CLI, c.text).group(1): c.text for c in rc.commands() if re.match(CLI, c.text)}
    assert sorted(cmds) == sorted(m.split(".")[1] for m, *_ in LIBS.values()), cmds   # one per library
    cmd = cmds[LIBS[lib][0].split(".")[1]]
    for entry in root.iterdir():          # the checkout's files, as in a clone; outputs stay here
        if entry.name not in ("tpprobe-runs",) and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    venv = Path(sys.executable).parent.parent
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "LANG": "C.UTF-8", "TERM": "dumb"}
    t0 = time.time()
    p = subprocess.run(["bash", "--noprofile", "--norc", "-c", f". {venv}/bin/activate && {cmd}"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    print(f"{cmd}: {time.time() - t0:.1f} s")
    assert p.returncode == 0 and "Traceback" not in p.stderr, (cmd, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "HEALTHY: every capture point agrees across ranks" in " ".join(p.stdout.split()), p.stdout[-2000:]
    (report,) = (tmp_path / "tpprobe-runs").glob("*/report.json")
    rep = json.loads(report.read_text())
    assert_healthy(cmd, {"code": p.returncode, "findings": rep["findings"], "coverage": rep.get("coverage", {}),
                         "allreduce": rep["allreduce"]}, 2, lib)


def build_partial_stream(ctx):
    """torch DTensor TP on blocks that keep DTensors in the stream (`use_local_output=False`): every
    block's row-parallel `down` returns a Replicate DTensor, except layer 2's, whose plan says
    `output_layouts=Partial()`: the layer returns a DTensor that still owes its reduce (DTensor
    reduces it lazily, in layer 3's first matmul)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tpprobe import ProbeTarget

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(96, 32)
            self.blocks = nn.Sequential(*[Block() for _ in range(4)])

        def forward(self, ids):
            return self.blocks(self.embed(ids)).to_local()

    torch.manual_seed(ctx.seed)
    model = Net().eval().requires_grad_(False)
    mesh = DeviceMesh.from_group(ctx.group or dist.group.WORLD, "cpu")
    parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate(), use_local_output=False)})
    for i, block in enumerate(model.blocks):
        down = RowwiseParallel(output_layouts=Partial() if i == 2 else Replicate(), use_local_output=False)
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": down})
    ids = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(1))
    return ProbeTarget(model=model, forward=lambda: model(ids.unsqueeze(0)), input_ids=ids, num_layers=4,
                       hidden_size=32, dtype=torch.float32, arch="dtensor-mlp")


def _sweep_cases(world):
    """The full matrix beside CI's subset: every fault in fp32 and bf16 (CI runs them in fp32 at tp 2),
    and at tp 4 every library healthy in both dtypes, with Megatron's sequence parallelism."""
    cases = [(f"{name}-{d}", factory, {"TPLIBS_DTYPE": d}) for name, (factory, _) in FAULTS.items()
             for d in ("float32", "bfloat16") if world > 2 or d == "bfloat16"]
    if world > 2:
        cases += _healthy_cases(LIBS, ("float32", "bfloat16"))
        cases += [(f"{lib}-sp-{d}", f"examples.{mod}:build_sequence_parallel", {"TPLIBS_DTYPE": d})
                  for lib, mod in (("megatron", "megatron_gpt"), ("dtensor", "dtensor_llama"))
                  for d in ("float32", "bfloat16")]
        cases += [(f"hf-sp_norms-{d}", "examples.hf_tp:build_sequence_parallel_norms", {"TPLIBS_DTYPE": d})
                  for d in ("float32", "bfloat16")]
    return cases


@pytest.mark.sweep
@pytest.mark.parametrize("world", [2, 4])
def test_sweep_every_fault_and_library_at_tp2_and_tp4_in_fp32_and_bf16(tmp_path, world):
    _need("dtensor", "hf", "megatron")
    cases = _sweep_cases(world)
    # 46 cases at tp 4 (34 before the sequence-parallel and attention cases): four processes on a shared
    # 2-core machine took over 600 s for 34 in one spawn
    res = _probe_all(tmp_path, world, cases, timeout=1800)
    for name, *_ in cases:
        base = name.rsplit("-", 1)[0]
        if base in FAULTS:
            assert_fault(base, res[name], world)
        else:
            assert_healthy(name, res[name], world, name.split("-")[0])
    assert_dtensor_sequence_parallel(res, world)


def test_the_documented_parameter_attributes_are_honoured_for_any_library():
    """docs/tp-libraries.md, "Parameter attributes for every other library": `tp_sharded = True` is never compared
    across ranks, `tp_replicated = True` always is (even inside a module whose class says sharded), an
    unmarked parameter of an unknown module is compared as unknown (None: stale only by a majority)."""
    import torch
    from torch import nn

    from tpprobe.capture.params import replicated_param_hashes

    class MyColumnShard(nn.Module):          # a class name no pattern knows
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 2))
            self.scale = nn.Parameter(torch.ones(4))

    class FooParallelLinear(nn.Module):      # the class says sharded
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, 2))
            self.gain = nn.Parameter(torch.ones(2))

    model = nn.ModuleDict({"a": MyColumnShard(), "b": FooParallelLinear()})
    hashes = replicated_param_hashes(model)
    assert {n: e["replicated"] for n, e in hashes.items()} == {"a.weight": None, "a.scale": None}
    model["a"].weight.tp_sharded = True
    model["a"].scale.tp_replicated = True
    model["b"].gain.tp_replicated = True
    hashes = replicated_param_hashes(model)
    assert {n: e["replicated"] for n, e in hashes.items()} == {"a.scale": True, "b.gain": True}
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tp-libraries.md")).read()
    assert "p.tp_sharded = True" in page and "p.tp_replicated = True" in page
