"""The coordinator side of gpipe: the job spec, the plan, and the driver of the stages."""
