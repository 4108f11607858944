"""Test helpers that run real processes: the CLI, N gloo ranks, SGLang ranks, the Triton interpreter."""
