"""Capture: what one rank records. hooks (the Tap), points (capture-point names), progress (where
the rank is), files (capture folders, read without executing anything), params (parameter hashes)."""
