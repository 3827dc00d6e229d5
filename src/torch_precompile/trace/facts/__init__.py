"""What a trace relies on besides its inputs, recorded while ``fn`` runs: Python values and
settings it read, hooks, values read off tensors, random and process state, writes to
parameters, and what ``fn`` does with ``.grad``; each becomes a check or a refusal."""
