"""Pipeline parallel: its stages and the runner that replays a schedule over the pp group."""
