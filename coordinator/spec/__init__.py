"""The job spec: job.yaml read (bounded), overridden on the command line, validated by pydantic, documented."""
