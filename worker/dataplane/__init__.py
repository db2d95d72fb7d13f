"""The data plane between stages: c10d (gloo, NCCL), point-to-point channels, same-host lanes and
their ring, and the replicas' gradient sums."""
