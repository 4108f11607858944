"""Tools: commands beside the probe. diff (two captures or dumps), layers (what EAGLE-3 layer ids
capture), specforge (SpecForge samples), offline (`tpprobe report DIR`)."""
