"""Starting and stopping ranks: local processes, torchrun/submitit, run-folder and checkpoint
locks."""
