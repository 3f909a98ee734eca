"""What a run will do and hold, computed from the config without torch: engine options, the
sample plan (and a batch ramp-up), Megatron's lr and weight-decay schedule, the memory plan, and
the fit and cost model of the search."""
