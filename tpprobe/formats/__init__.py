"""Formats: files tpprobe reads and writes: capture folders (capture_dir, read without executing
anything) and the run settings their manifests carry (settings), SGLang dumper folders (sglang_dump),
SpecForge EAGLE-3 samples (specforge), and the one `.pt` loader they all read through (safe_load)."""
