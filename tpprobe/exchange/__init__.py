"""Exchange: how ranks talk. dist (process group, store channel, watchdog), gather (metadata first,
then tensors or fingerprints to rank 0), fingerprint (+ _hashdef shared with the Triton kernel),
live (rank 0's progress display)."""
