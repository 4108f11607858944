"""Exchange: how ranks talk. dist (process group, store channel, watchdog), gather (metadata first,
then tensors or fingerprints to rank 0), liveness (who is still alive)."""
