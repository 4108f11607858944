"""EAGLE-3: two runs compared slot by slot (diff) and what a capture costs the draft model (accept)."""
