"""Capture-point names: `embed.out`, `embed.local`, `layer.K.out`, `layer.K.in_norm`, `aux.packed`,
`allreduce.N.in|out` — what each one means and where it sits in model order.
"""
from __future__ import annotations

from typing import Optional


def point_layer(name: str) -> Optional[int]:
    parts = name.split(".")
    if parts[0] == "layer" and len(parts) > 1 and parts[1].lstrip("-").isdigit():
        return int(parts[1])
    return -1 if name.startswith("embed") else None


def id_point(layer_id: int) -> str:
    return "embed.out" if layer_id == -1 else f"layer.{layer_id}.out"


def point_label(name: str) -> str:
    if name == "embed.out":
        return "the embedding"
    if name == "embed.local":
        return "the embedding's local (pre-reduce) output"
    if name.endswith(".in_norm"):
        return f"layer {point_layer(name)}'s input norm output"
    return f"layer {point_layer(name)}'s output" if point_layer(name) is not None else name


def stream_order(names) -> list[str]:
    """embed.out, then layer.K.out in K order (the residual stream in model order)."""
    layers = sorted((point_layer(n), n) for n in names if n.startswith("layer.") and n.endswith(".out"))
    return (["embed.out"] if "embed.out" in names else []) + [n for _, n in layers]
