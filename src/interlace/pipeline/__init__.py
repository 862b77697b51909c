"""Pipeline model parallelism: partitioning, schedules, weight prediction and the runtime."""
