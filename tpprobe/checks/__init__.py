"""Checks: from every rank's record to findings. run (the order), one module per family (liveness,
collectives, crossrank, allreduce, stream, slots, layout, params, reference), evidence (tensors
or fingerprints judged alike), noise (the rule for "equal within rounding"), findings."""
