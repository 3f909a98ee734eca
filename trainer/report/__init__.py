"""What a person sees: layout.json's record, the dry run, a measured rank, launch.log, plots."""
