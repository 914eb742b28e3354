"""Parallelism on the ("pp", "dp", "tp") mesh: TP plans, data parallelism, pipeline stages."""
