"""Capture: what one rank records. hooks (the Tap), audit (every collective), discover (a model's layers),
points (capture-point names), graph_tap (capture inside a CUDA graph), record (one rank's record and its
schema check), params (parameter hashes), progress (where the rank is)."""
