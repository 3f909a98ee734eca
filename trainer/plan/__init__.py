"""What a run will do and hold, computed from the config without torch: engine options,
the sample plan, the lr schedule, the memory plan, and the fit and cost model of the search."""
