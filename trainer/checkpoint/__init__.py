"""Checkpoints: DCP save/load at global offsets (any layout), checksums, and the checkpoint a
run starts from."""
