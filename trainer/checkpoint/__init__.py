"""Checkpoints: DCP save/load at global offsets (any layout), and which one to resume."""
