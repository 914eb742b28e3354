"""Opt-in observers of a training run, passed to `train(cfg, hooks=[...])`: what tests and
tools want from a run that a user's run does not pay for.

A hook has `on_step(run, step, out, metrics)` (after each step's metrics; `out` is the step's
`StepOutput`) and/or `on_end(run, result)` (after the last step, before `train` returns).

    hashes = BatchHashes()
    result = train(cfg, hooks=[hashes, KeepModel()])
    hashes.hashes, result.model
"""

from __future__ import annotations

import hashlib


class BatchHashes:
    """A short digest of each step's microbatches (inputs and labels) on this rank, to compare
    the data two runs read (e.g. a resumed run against an uninterrupted one)."""

    def __init__(self):
        self.hashes: list[str] = []

    def on_step(self, run, step: int, out, metrics: dict) -> None:
        h = hashlib.sha1()
        for inputs, labels, *_ in out.batches:
            h.update(inputs.numpy().tobytes())
            h.update(labels.numpy().tobytes())
        self.hashes.append(h.hexdigest()[:16])


class KeepModel:
    """Hand the trained model (or a ModuleList of this rank's stages), its optimizer and mesh
    back on the result (`result.model`, `.optimizer`, `.mesh`); without it they are freed."""

    def on_end(self, run, result) -> None:
        result.model, result.optimizer, result.mesh = run.model(), run.optimizer, run.mesh
