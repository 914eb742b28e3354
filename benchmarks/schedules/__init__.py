"""The pipeline-schedules benchmark: `python benchmarks/schedules` runs `__main__.py`.

`sim.py` replays torch's action tables with per-action costs (the lowest module), `record.py`
times and meters a real pipeline's actions, `measure.py` runs it on forked ranks, `report.py`
writes the tables, chart and JSON.
"""
