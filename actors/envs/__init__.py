"""Multi-turn environments: the env interface and its worker pool (env.py), token-exact turns (turns.py), the
batched episode loop (episode.py), and the shipped lookup environment (lookup.py)."""
