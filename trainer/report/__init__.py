"""What a person sees: the dry run, the memory plan, metrics, logs and plots."""
