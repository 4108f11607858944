"""What the probe needs to know about this rank and the model it probes.

`RankContext` is handed to every model factory (built-in, SGLang, or a user's
`--model package.module:factory`); the factory returns a `ProbeTarget`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch



@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str                      # "gloo" | "nccl"
    group: Any = None                 # the TP process group the model reduces over (None = WORLD)
    seed: int = 0

    def __repr__(self) -> str:
        return f"RankContext(rank={self.rank}/{self.world_size}, {self.backend}, {self.device})"


@dataclass
class ProbeTarget:
    """A model ready to run one forward on this rank.

    forward() runs the forward pass (no grad is set by the probe) and returns whatever the model
    returns. The decoder layers are the model's longest nn.ModuleList and the embedding is the
    module that consumes input_ids and emits [tokens, hidden], unless `layer_list` / `embed` name
    them (a module path such as "model.layers", or a class-name glob such as "*DecoderLayer").
    """

    model: torch.nn.Module
    forward: Callable[[], Any]
    input_ids: torch.Tensor                 # [tokens], identical on every rank
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    # the architecture as the report shows it; "builtin" only for tpprobe's own model, whose
    # unsharded tp=1 reference streams the checks compare against
    arch: str = "custom"
    # The model's own packed aux hidden state (what the EAGLE-3 draft receives), when the model
    # packs it itself (SGLang): called after forward(); None when the probe packs from its hooks.
    packed_aux: Optional[Callable[[Any], Optional[torch.Tensor]]] = None
    # Ids the model itself was told to capture (SGLang set_eagle3_layers_to_capture), if any.
    model_layer_ids: Optional[list[int]] = None
    # Free-form facts shown in the report's settings (vocab, config path, ...).
    info: dict = field(default_factory=dict)
    # Model-specific capture added to the Tap: each is called with the Tap on enter and returns
    # handles with .remove(); it records points with tap.record_point(name, tensor).
    tap_extensions: tuple = ()
    # Overrides of what structure finds (the CLI's --embed / --layer-list win over these).
    embed: Optional[str] = None
    layer_list: Optional[str] = None
    # False when decoder layers do not return (hidden_states, residual) (SGLang 0.5.23's owed
    # output): the extension records layer.K.out instead.
    stream_from_layer_output: bool = True
    # Several prompts in one forward, as the model batches them (`tpprobe invariance`): called with
    # a list of id tensors (input_ids among them), returns what forward() returns. batch_layout says
    # where a prompt's token rows are in the captured activations: "packed" = the prompts' rows one
    # after the other along dim 0 (SGLang's EXTEND batch), "padded" = [batch, longest, ...] with
    # each prompt's rows first in its row of dim 0. None: the model runs one prompt at a time.
    forward_batch: Optional[Callable[[list], Any]] = None
    batch_layout: str = "packed"
