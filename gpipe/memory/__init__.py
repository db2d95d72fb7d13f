"""What a stage holds and costs: activation memory counted, each worker's peak predicted, layers' measured
costs, and the optimizer state sharded across replicas (ZeRO-1)."""
