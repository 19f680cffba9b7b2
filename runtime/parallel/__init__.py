"""Tensor and pipeline parallelism at run time: what each rank holds (layout), the process groups,
the step message the driver broadcasts, the worker processes and the driver's model runner."""
