"""Report: model (the report.json dict), emit (its sinks), renderers (terminal, html, markdown) that
share labels and never import each other, envinfo (the environment header), live (rank 0's progress)."""
