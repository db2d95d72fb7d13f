"""A job's outputs on the coordinator's disk: its folder, checkpoints, weights for evaluation, timelines."""
