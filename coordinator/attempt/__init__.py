"""One attempt of a job, in a process of its own: plan, resume, drive the stages over RPC, report."""
