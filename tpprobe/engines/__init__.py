"""Engines: the model sources tpprobe probes, side by side, one package each (builtin, sglang, vllm; user: a
--model factory), each an `Engine` (engine) the rest of tpprobe asks through one registry (registry); the
coordinator audit door the serving engines share (door), the fault op their faults share (fault_ops) and
what both plugins write per captured step (step)."""
