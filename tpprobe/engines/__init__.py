"""Engines: the serving engines tpprobe probes with their own model classes, side by side, one package
each (sglang, vllm), the coordinator audit door they share (door), the fault op their faults share (fault_ops)
and what both plugins write per captured step (step)."""
