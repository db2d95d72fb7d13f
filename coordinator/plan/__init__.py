"""Before any worker starts: the job's plan (model, cut, data), the fastest configuration that fits
(`plan`), each worker's predicted memory, elastic shapes and the stages' configs."""
