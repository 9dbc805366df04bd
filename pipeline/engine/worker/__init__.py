"""Executing a step: the model runner turns scheduled pieces into tensors and runs the model over the paged
cache (eager, or a replayed decode graph); the loader builds the model it runs; the kernel choice."""
