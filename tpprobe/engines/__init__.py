"""Serving engines tpprobe probes with their own model classes, side by side (vllm/ here; the house
moves tpprobe/sglang to engines/sglang)."""
