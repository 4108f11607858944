"""Tools: commands beside the probe. diff (two captures or dumps), layers (what EAGLE-3 layer ids
capture), specforge (SpecForge samples), offline (`tpprobe report DIR`), dumper (SGLang's dumper
folders), accept (what a capture costs the draft). `tpprobe invariance` is tpprobe/invariance/."""
