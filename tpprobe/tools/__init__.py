"""Commands built on the probe: one module each (tpprobe invariance, ...)."""
