"""Built-in: tpprobe's own TP model (model), the faults --inject puts into it (faults), its graph-captured GPU
proof harness (graph), and the model source `--engine builtin` (engine)."""
