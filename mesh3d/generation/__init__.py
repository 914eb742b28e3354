"""Text from a trained model: token picking (`sampling.py`), one process (`single.py`) and
tp/pp under torchrun (`parallel.py`), both under `mesh3d generate` (`mesh3d/generate.py`)."""
