"""The backend the multi-rank tests run on: the same test bodies on gloo (CPU, the default suite)
and on NCCL (`pytest -m gpu` on a GPU machine, as many ranks as it has GPUs).

Every process the tests start inherits OMP_WAIT_POLICY=PASSIVE (unless it is set already): an OpenMP
worker with nothing to do sleeps instead of spinning. The ranks keep torch's default thread count and
run the same code; on a 2-core CI box the spinning workers of 2 to 4 ranks, each with its own pool,
took the cores from the ranks that had work (a tp-4 probe took 3x longer)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch (and its OpenMP) is loaded

import pytest  # noqa: E402
import torch  # noqa: E402


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(params=[pytest.param("gloo"), pytest.param("nccl", marks=pytest.mark.gpu)])
def backend(request) -> str:
    if request.param == "nccl" and gpu_count() < 2:
        pytest.skip("NCCL at tp >= 2 needs 2 GPUs; this machine has fewer (the fingerprint GPU tests still run)")
    return request.param


def ranks_for(backend: str, nproc: int) -> int:
    """The ranks a case runs on: NCCL needs one GPU per rank; a case that needs more GPUs than
    the machine has is skipped on it, saying so (it ran on gloo in CI)."""
    if backend == "nccl" and nproc > gpu_count():
        pytest.skip(f"needs {nproc} GPUs for NCCL, this machine has {gpu_count()} (runs on gloo in CI)")
    return nproc


def needs_gpus(n: int):
    """The marks of a GPU-tier case that runs n NCCL ranks (one GPU each): `gpu`, and a skip that
    says why on a machine with fewer than n GPUs (torch.cuda.device_count(), read at collection)."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPUs for NCCL (one per rank), this machine has "
                                                       f"{gpu_count()} (runs on gloo in CI)")]


# (backend, under torchrun): gloo through `tpprobe probe --nproc` in CI; NCCL through both
# launchers on the GPU machine
LAUNCHES = [pytest.param("gloo", False, id="gloo"),
            pytest.param("nccl", False, marks=needs_gpus(2), id="nccl"),
            pytest.param("nccl", True, marks=needs_gpus(2), id="nccl-torchrun")]
