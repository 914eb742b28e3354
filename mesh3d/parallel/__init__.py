"""Parallelism on the ("pp", "dp", "cp", "tp") mesh: TP plans, data parallelism, pipeline stages,
context parallelism."""
