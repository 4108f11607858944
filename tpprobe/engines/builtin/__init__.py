"""Built-in: tpprobe's own TP model (model), the faults --inject puts into it (faults), and its
graph-captured GPU proof harness (graph)."""
