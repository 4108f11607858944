"""The one-process decode setup the host-time benches share (tap_phases, forward_split, decode_trace).

A world-1 group (NCCL on a GPU with --collectives, else gloo), the built-in model on the device with
its weights drawn there, and with --collectives the all-reduces a tp-2 model issues (the embedding's
and every row-parallel output, over the world-1 group: the audit's and the fingerprints' host cost per
collective on a real communicator); the input ids; and what `--exchange fingerprint` keeps (the 3
EAGLE-3 slots, embed.*, in_norm)."""
import os

import torch
import torch.distributed as dist

from bench.hook_overhead import weights_on
from tpprobe.capture.points import id_point
from tpprobe.core.target import RankContext
from tpprobe.engines.builtin.model import BuiltinConfig, TPModel

LAYER_IDS = [-1, 1, 3]


def add_model_args(ap) -> None:
    """The model's and the decode's arguments: --hidden --heads --num-layers --vocab --tokens --collectives."""
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--collectives", action="store_true", help="all-reduce the embedding's and every "
                    "row-parallel output (a world-1 NCCL group on CUDA), where a tp-2 model issues them")


def decode_model(a, dtype=None):
    """(model, ids, keep, device, sync): ``a`` has num_layers, hidden, heads, vocab, tokens, collectives and
    device (cuda when it has none); dtype: bf16 on a GPU, fp32 on the CPU unless given."""
    dev = torch.device(getattr(a, "device", "cuda"))
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    nccl = dev.type == "cuda" and a.collectives
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if nccl else "gloo", rank=0, world_size=1, **({"device_id": dev} if nccl else {}))
    cfg = BuiltinConfig(num_layers=a.num_layers, hidden=a.hidden, heads=a.heads, ffn=2 * a.hidden, vocab=a.vocab,
                        tokens=a.tokens, dtype=dtype, layer_ids=LAYER_IDS)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device=dev, backend="nccl" if nccl else "gloo")
    with torch.no_grad():
        model = TPModel(weights_on(cfg, dev), ctx, cfg).to(dev).eval()
    model.set_eagle3_layers_to_capture(LAYER_IDS)
    if a.collectives:
        for m in [model.embed_tokens] + [x for l in model.layers for x in (l.self_attn.o_proj, l.mlp.down_proj)]:
            m.register_forward_hook(lambda mod, args, o: dist.all_reduce(o))
    ids = torch.randint(0, a.vocab, (a.tokens,), generator=torch.Generator().manual_seed(0)).to(dev)
    keep_ids = {id_point(i) for i in LAYER_IDS}
    return model, ids, (lambda n: n in keep_ids or n.startswith("embed") or n.endswith("in_norm")), dev, sync
