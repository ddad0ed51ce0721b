"""DeepSpeed's autotuner for pretrain_gpt.py: the settings to search (space.py), one trial in its own
process (trial.py), and the search with its ranked table and outputs (tuner.py)."""
