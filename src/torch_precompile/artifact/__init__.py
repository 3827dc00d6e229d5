"""Stage 3: the artifact pair, ``python_code`` (source) and ``cache`` (acceleration bytes)."""
