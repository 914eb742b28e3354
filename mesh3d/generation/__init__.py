"""Text from a trained model: token picking (`sampling.py`), the one-process model
(`single.py`) and the tp/pp model under torchrun (`parallel.py`). The `mesh3d generate`
command (`mesh3d/generate.py`) sits above both paths; the end-of-run summary uses `single.py`.
"""
