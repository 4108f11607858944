"""Probe: the pipeline every rank runs (pipeline), what it prepares before the forward (prepare), the
forward (forward), the GPU settle after it (settle), and how ranks are started (launch)."""
