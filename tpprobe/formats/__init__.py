"""Formats: files tpprobe reads and writes: capture folders (capture_dir, read without executing
anything), SGLang dumper folders (sglang_dump) and SpecForge EAGLE-3 samples (specforge)."""
