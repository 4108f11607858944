"""Does NCCL take two ranks on ONE GPU on this machine?  Two processes, both on cuda:0, one
all-reduce.  NCCL refuses ("Duplicate GPU detected") since 2.x: then tp 2 over NCCL needs 2 GPUs
(the 2-GPU kind), and the one-GPU machine can only run tp 1 over NCCL or tp 2 over gloo."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    try:
        dist.init_process_group("nccl", rank=r, world_size=2, device_id=dev)
        x = torch.ones(4, device=dev) * (r + 1)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        q.put((r, f"ok: all_reduce gave {x.tolist()}"))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        q.put((r, f"refused: {type(e).__name__}: {str(e).splitlines()[0][:300]}"))


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = {}
    try:
        for _ in ps:
            r, msg = q.get(timeout=45)
            got[r] = msg
    except Exception:  # noqa: BLE001
        pass
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())), "two ranks on cuda:0:")
    for r in range(2):
        print(f"  rank {r}: {got.get(r, 'no answer within 45 s (hung or died)')}")
