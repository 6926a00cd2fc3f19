"""Sequences, scheduling policies, executors, sampling, the engine loop and its trace."""
