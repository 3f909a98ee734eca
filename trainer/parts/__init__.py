"""Model parts as registered pieces: shapes and parallel plan from the config alone (no torch)."""
