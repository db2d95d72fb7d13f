"""The service as users run it, in processes: `run`, serve, gpipe-worker daemons and the client verbs, over real
sockets; faults, restarts, preemption, the data plane, the network. Each such test is marked `multiprocess`."""
