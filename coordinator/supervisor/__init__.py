"""The supervisor, for `run` and `serve` alike: jobs, workers, attempts, the shared pool and its policy."""
