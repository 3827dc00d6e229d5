"""Module-level state of the user's own code that a traced fn may change (test_python_state)."""

STATE = {"step": 0}
SCALE = 1.0
