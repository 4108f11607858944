"""The GPU tier on a one-GPU machine: every case that runs NCCL over 2 ranks
skips, saying it needs 2 GPUs, instead of failing with `--backend nccl needs one GPU per rank`.

A pytest of the GPU tier runs in a subprocess with a plugin that makes torch report one CUDA device
(`torch.cuda.is_available()` True, `device_count()` 1), the machine the finding was seen on; the
two-GPU cases must come out skipped with the reason, and none may run (here they would fail:
this machine has no GPU for the ranks they start)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ONE_GPU = '''
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
'''

TWO_GPU_CASES = [
    "tests/ranks/test_faults.py::test_a_hung_rank_stops_the_others_within_the_timeout[nccl]",
    "tests/ranks/test_faults.py::test_a_hung_rank_stops_the_others_within_the_timeout[nccl-torchrun]",
    "tests/ranks/test_faults.py::test_a_killed_rank_leaves_the_live_ranks_capture_written[nccl]",
    "tests/ranks/test_faults.py::test_a_killed_rank_leaves_the_live_ranks_capture_written[nccl-torchrun]",
    "tests/ranks/test_faults.py::test_an_extra_collective_is_named_not_a_timeout[nccl-torchrun]",
    "tests/gpu/test_graph_tap.py::test_graph_replay_fingerprints_equal_eager_at_every_point[2]",
    "tests/gpu/test_graph_tap.py::test_healthy_graph_replay_has_no_findings[2]",
    "tests/gpu/test_graph_tap.py::test_faults_in_the_graphed_model_are_named_exactly[2]",
]


def test_two_gpu_nccl_cases_skip_saying_why_on_one_gpu(tmp_path):
    (tmp_path / "one_gpu.py").write_text(ONE_GPU)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    env = {**os.environ, **env}
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "one_gpu", "-m", "gpu", "-rs", "-q",
                        "-p", "no:cacheprovider", *TWO_GPU_CASES], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert f"{len(TWO_GPU_CASES)} skipped" in out and "passed" not in out and "failed" not in out, out[-4000:]
    why = re.findall(r"SKIPPED \[(\d+)\] [^\n]*: needs 2 GPUs for NCCL \(one per rank\), this machine has 1 ", out)
    assert sum(map(int, why)) == len(TWO_GPU_CASES), out[-4000:]
