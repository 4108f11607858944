"""Dumper folders: SGLang's dumper output checked and compared across ranks and runs (dumper)."""
