"""The single-device model, and its plan: which modules parallel code splits and how."""
