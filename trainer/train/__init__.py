"""One rank training: the engine it builds, the step, the optimizer, recompute, the loop, its
metrics and its signal watch."""
