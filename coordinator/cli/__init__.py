"""gpipe-coordinator's verbs: run on this machine, the client of serve, tokenize."""
