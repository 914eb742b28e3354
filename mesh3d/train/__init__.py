"""Training: optimizer, LR schedule, loss, metrics and the step loop; called, the whole run.

Callable as `train/loop.py`'s `train`, since Python binds `mesh3d.train` to this package once
any `mesh3d.train.*` module is imported.

Example:

    result = mesh3d.train(mesh3d.load_config("cfg.yaml"), hooks=[])   # under torchrun
    [m["lm_loss"] for m in result.metrics]
"""

import sys
import types


class _TrainPackage(types.ModuleType):
    def __call__(self, cfg, metrics_file=None, hooks=()):
        """`mesh3d.train.loop.train(cfg, metrics_file, hooks)`: the rank-local `RunResult`."""
        from mesh3d.train.loop import train

        return train(cfg, metrics_file, hooks)


sys.modules[__name__].__class__ = _TrainPackage
