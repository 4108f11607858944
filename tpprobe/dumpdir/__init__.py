"""Dumper folders: SGLang's dumper output checked across ranks (check), compared across runs (diff), dims (dims)."""
