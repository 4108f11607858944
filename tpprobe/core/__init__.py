"""Core: the ground floor every wing stands on: errors, the probe target contract, the noise rule, CUDA and
tensor helpers. Imports no other part of tpprobe."""
