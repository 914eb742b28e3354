"""What a loader worker sends the training process, by value: an exception it raised, and
batches as numpy arrays. A torch tensor would travel as a file descriptor fetched from the
worker when unpickled: a worker stopped at that moment would hang the training process."""

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


def by_value(batches: list) -> list:
    """Microbatches of tensors as numpy arrays when in a worker (as they are in the process)."""
    if get_worker_info() is None:
        return batches
    return [tuple(t.numpy() for t in mb) for mb in batches]
