"""The service's decisions, in process: the spec and its plan, job records, the supervisor's state machine, the
driver over local stages, checkpoints, a job's code, pretrained weights; no process started."""
