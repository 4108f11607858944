"""Engines: the serving engines tpprobe probes, side by side, one package each (sglang), and the fault op
their faults share (fault_ops)."""
