"""What runs a step above the model and the optimizer: the plain and pipeline step runners,
schedules, data-parallel reduction, FSDP, gradient sync and norms."""
