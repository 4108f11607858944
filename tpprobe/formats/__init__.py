"""Formats: files tpprobe reads and writes: capture folders (capture_dir, read without executing
anything) and SpecForge EAGLE-3 samples (specforge)."""
