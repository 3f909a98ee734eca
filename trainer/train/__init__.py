"""One rank training: the engine it builds, the step, the optimizer, the schedule, the loop."""
