"""An exception raised while reading data in a loader worker, carried to the training process as
a value: the DataLoader's own re-raise prints the worker's whole traceback, mesh3d one line."""

from __future__ import annotations

from torch.utils.data import get_worker_info

from mesh3d.errors import UserError


class Failed:
    """What went wrong (`text`), whether it is the user's to fix, and which worker saw it."""

    def __init__(self, error: BaseException):
        self.user = isinstance(error, UserError)
        self.text = str(error) if self.user else f"{type(error).__name__}: {error}"
        info = get_worker_info()
        self.worker = None if info is None else info.id
