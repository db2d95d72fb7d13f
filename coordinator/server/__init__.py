"""`gpipe-coordinator serve`: the gRPC job and worker APIs, their authentication, submissions, the job
table on disk and /metrics."""
