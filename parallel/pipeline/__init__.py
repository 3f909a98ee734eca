"""Pipeline parallel: schedules (pure) and their execution over the pp group."""
