"""Starting and stopping ranks: local processes, torchrun/submitit, signals, run-folder locks."""
