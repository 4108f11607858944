"""Checks: from every rank's record to findings. run (the order), one module per family (liveness,
collectives, crossrank, allreduce, stream, slots, layout, params, reference), evidence (tensors
or fingerprints judged alike, by the noise rule of core/noise.py), findings."""
