"""`recipes/train.py` with tensor parallelism's CPU pair swap turned off: the blocks' activations
go through gloo's all-reduce / all-gather / reduce-scatter as on any other group size. The
"collective" way of `benchmarks/tp_collectives.py`; takes `recipes/train.py`'s arguments."""

import runpy
import sys
from pathlib import Path

from mesh3d import tp_styles

# no group gets the pair's collectives: every one keeps c10d's (tp_styles.C10D)
tp_styles.choose_collectives = lambda group, device_type: None
sys.argv[0] = str(Path(__file__).resolve().parents[1] / "recipes/train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
